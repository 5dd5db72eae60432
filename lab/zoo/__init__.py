"""How the shipped tiny family was made: training (`lab.zoo.train`, run by `examples/train_tiny_family.py`), the
scoring of its corpus tasks for the learning curves (`lab.zoo.tasks`) and the family's README (`python -m
lab.zoo.report`). The family itself, its tokenizer, corpus and loading are the library's (`hf_kvmap.zoo`)."""
