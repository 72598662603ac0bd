"""The draft families and their on-disk format: the layer draft, a small Llama built from the
target's layers (layer.py); the head, one decoder layer over the target's hidden states
(head.py); the family's spec and the errors of building or loading a draft (spec.py, light:
pydantic only); a draft directory's files and their atomic write (files.py). Imports
target.py, config.py and common/; the registry (above) stores what these write."""
