"""What a job costs: ``prices`` ($ per million tokens: flags, a price file, a built-in
table), ``tokens`` (a task's tokens counted with the model's tokenizer) and ``estimate``
(``carpool run --estimate``: the tokens and $ of a run, before anything is sent).
"""
