"""Models pushed by the fleet, on the device: :mod:`~edge.models.manager` (offers, the status),
:mod:`~edge.models.fetch` (chunks in bounded memory), :mod:`~edge.models.install` (activation,
rollback, refusals on disk), :mod:`~edge.models.transfer` (one file's bytes) and
:mod:`~edge.models.onnx` (a model in onnxruntime).  Import from the module: this package imports
nothing, so the serving code can use :mod:`edge.models.onnx` without the manager."""
