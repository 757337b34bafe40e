"""zerocc where users already train: a Hugging Face Trainer (:mod:`.transformers`, TRL's
trainers through its mixin) on a zerocc step by one argument, ``plan=``.

Each integration is imported by name (``zerocc.integrations.transformers``), so zerocc itself
needs none of their packages (the ``hf`` extra installs them).
"""
