"""torch → ONNX that a device can trust, and the package that carries it to the fleet.

Only ``onnx_export`` and ``pipeline`` import torch.  ``keys`` (Ed25519 key pair and
signing), ``package`` (signed manifest beside the ONNX file), ``quantize`` (int8
dynamic quantization and its report), ``runtime`` (onnxruntime sessions) and
``synthetic`` (ONNX encoders of any size for tests and benchmarks) do not; the
device's half — manifest parsing and signature verification — is ``ioft_protocol.manifest``.
"""
