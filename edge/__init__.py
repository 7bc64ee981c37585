"""The device side: ``edge-trainer`` (rounds, serving) and ``edge-recorder`` beside it.

Modules that moved keep importing from their old paths, with a ``DeprecationWarning``, until
version 0.2.0 (:mod:`ioft_protocol.moved`).
"""

from ioft_protocol.moved import keep_moved

REMOVED_IN = "0.2.0"
#: Old module path (under ``edge.``) -> where it lives now.
MOVED = {
    "manifest": "ioft_protocol.manifest",
    "model_transfer": "edge.models.transfer",
    "mqtt": "ioft_protocol.mqtt",
    "onnx_model": "edge.models.onnx",
    "serving.feed": "edge.feed",
    "serving.jsonlog": "edge.jsonlog",
    "state": "ioft_protocol.state",
}
keep_moved({f"edge.{old}": new for old, new in MOVED.items()}, REMOVED_IN)
