"""The fleet protocol, shared by the device (``edge``) and the cloud (``cloud_aggregator``, ``export``).

Modules: ``codec`` (payload encoding and tensor checks), ``topics`` (topic names), ``rounds``
(round announcements and updates), ``model_push`` (model offers and chunks), ``mqtt`` (the
MQTT session; ``mqtt_options`` what it connects with, ``mqtt_tls`` its TLS checks,
``mqtt_diagnosis`` why an attempt failed, ``mqtt_inbound`` its inbound queue), ``restate``
(how retained state also travels live, for brokers that keep it per node), ``state`` (atomic
file I/O), ``config`` (TOML to dataclass), ``manifest`` (the signed model manifest).  It imports
no other project package but the leaf ``trainer_lite.params``.

The wire:

Payloads are safetensors bytes (a JSON header, then raw little-endian tensors; no
pickle, nothing executable) whose ``__metadata__`` holds one key, ``ioft``: a JSON
object with the protocol version, the message kind and its fields.  Every decode
checks the size first, then the format, then the fields; tensors are validated
against what the round expects (names, shapes, dtype, finiteness) before they may
reach an aggregator.

Topics, all under ``ioft/v1/<fleet>/``::

    task/<task>/down            retained  round announcement + global shared parameters
    task/<task>/down/<device>   retained  per-device downlink (algorithms that personalize it)
    task/<task>/up/<device>               a device's update for a round and phase
    status/<device>             retained  device status (JSON); the Last Will says offline
    rollcall                              the aggregator asks every device to re-publish its status
    model/<name>/manifest       retained  a signed model manifest and its transfer table
    model/<name>/<version>/chunk/<i>  retained  one chunk of that model's ONNX file

A device may only write ``.../up/<itself>`` and ``status/<itself>``; the broker's
ACL (``cloud-aggregator fleet init``) enforces it.
"""
