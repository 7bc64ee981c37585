"""Cloud backbones in torch: training on data the cloud may hold, and assembly of what the fleet learned.

``data`` (NumPy) builds the training sets from the machine simulators, ``nets``
defines the torch modules (whose parameter names are the fleet's names, so they
survive as ONNX initializer names), ``train`` trains with progress, checkpoints
and resume, and ``assemble`` turns federated shared parameters (a ``trainer_lite``
model's named NumPy dict) into a torch module for export.  Only ``data`` is
importable without torch.
"""
