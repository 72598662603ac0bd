"""`osd draft init`: the first draft, distilled offline from the target's own answers, for the
layer family (layer.py) and the head (head.py). Imports teacher/, gate/ and distill/ (and
infra/), never online/."""
