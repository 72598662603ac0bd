"""How a draft learns from records: records packed into batches (batching.py), distillation
losses against the sparse top-K target (losses.py), the objective the engine steps on
(objective.py), the head's target features and unrolled loss (head.py), the draft vocabulary
from token counts (draft_vocab.py), and the one object that owns DeepSpeed (ds_engine.py).
Imports infra/ only."""
