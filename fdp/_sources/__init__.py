"""Where params come from without a whole model on any rank: a model built on the meta device
initialised module by module (``deferred.py``, ``fdp.deferred_init``), HF-style safetensors
checkpoints read range by range and written unit by unit (``safetensors.py``), and the meta
trees and whole reads they share (``trees.py``)."""
