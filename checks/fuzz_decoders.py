"""Fuzz every decoder of untrusted bytes: wire payloads, manifests, configs, sensor files.

Contract checked for each decoder: it returns a valid object or raises its documented
error type (``allowed``), never anything else, never hangs (an input over
``--hang-s`` seconds is a finding), and memory stays bounded (peak RSS reported).

Inputs come from two generators that share one mutator:

* **byte mutations** of valid seeds (bit flips, interesting bytes and little-endian
  integers, inserts, deletes, duplicated blocks, truncation, splices of two seeds);
* **structured** inputs: valid containers around mutated fields (a safetensors
  payload whose ``ioft`` metadata has fields replaced by random JSON values, a TOML
  document with random values for known keys, JSON sidecars and label rows with
  random values), so inputs pass the outer format and reach field validation.

``tests/checks/test_fuzz_decoders_quick.py`` runs both through hypothesis (``st.randoms`` drives the mutator) with
a budget of seconds; ``python -m checks.fuzz_decoders --examples N`` runs N inputs
per decoder with a seeded ``random.Random`` (hypothesis' per-example overhead is
larger than most decoders' cost) and writes ``checks/results/fuzz_decoders.md``.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import random
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import markdown_table, peak_rss_mb, progress, study_parser, write_result

RESULTS = Path(__file__).resolve().parent / "results"

INTERESTING_BYTES = (0x00, 0x01, 0x7F, 0x80, 0xFF, ord("{"), ord("}"), ord('"'), ord(","), ord("\n"))
INTERESTING_INTS = (
    0,
    1,
    2,
    7,
    8,
    127,
    128,
    255,
    256,
    2**15,
    2**16 - 1,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**63 - 1,
    2**64 - 1,
)
JSON_VALUES: tuple[Any, ...] = (
    None, True, False, 0, -1, 1, 2**31, 2**63, -(2**63), 10**30, 1.5, -0.0, 1e308, "", "x", "a" * 300,
    "ab" * 32, "\u0000", "\ud7ff", [], [None], [1, 2], ["a"], {}, {"a": 1}, {"": None},
)  # fmt: skip
MAX_INPUT = 64 * 1024


# -- the mutator ------------------------------------------------------------------------
def mutate(data: bytes, rnd: random.Random, pool: list[bytes], max_size: int = MAX_INPUT) -> bytes:
    """1-8 random byte-level edits of ``data`` (``pool`` for splices)."""
    buf = bytearray(data)
    for _ in range(rnd.randint(1, 8)):
        op = rnd.randrange(9)
        n = len(buf)
        if op == 0 and n:  # flip a bit
            i = rnd.randrange(n)
            buf[i] ^= 1 << rnd.randrange(8)
        elif op == 1 and n:  # an interesting byte
            buf[rnd.randrange(n)] = rnd.choice(INTERESTING_BYTES)
        elif op == 2 and n >= 1:  # an interesting little-endian integer (lengths, counts)
            width = rnd.choice((1, 2, 4, 8))
            v = rnd.choice(INTERESTING_INTS) % (1 << (8 * width))
            i = rnd.randrange(n)
            buf[i : i + width] = v.to_bytes(width, "little")
        elif op == 3:  # insert random bytes
            i = rnd.randint(0, n)
            buf[i:i] = bytes(rnd.randrange(256) for _ in range(rnd.randint(1, 16)))
        elif op == 4 and n:  # delete a range
            i = rnd.randrange(n)
            del buf[i : i + rnd.randint(1, max(1, n // 8))]
        elif op == 5 and n:  # duplicate a block
            i = rnd.randrange(n)
            block = buf[i : i + rnd.randint(1, 64)]
            j = rnd.randint(0, n)
            buf[j:j] = block * rnd.randint(1, 4)
        elif op == 6 and n:  # truncate
            del buf[rnd.randrange(n) :]
        elif op == 7 and pool:  # splice with another seed
            other = rnd.choice(pool)
            i, j = rnd.randint(0, n), rnd.randint(0, len(other))
            buf = buf[:i] + other[j:]
        elif op == 8 and n:  # an ASCII digit run (numbers in text formats)
            i = rnd.randrange(n)
            buf[i:i] = str(rnd.choice(INTERESTING_INTS) * rnd.choice((1, -1))).encode()
    return bytes(buf[:max_size])


def random_json(rnd: random.Random, depth: int = 0) -> Any:
    r = rnd.random()
    if depth < 2 and r < 0.1:
        return [random_json(rnd, depth + 1) for _ in range(rnd.randint(0, 3))]
    if depth < 2 and r < 0.2:
        return {
            rnd.choice(["a", "b", "", "x" * 5]): random_json(rnd, depth + 1) for _ in range(rnd.randint(0, 3))
        }
    if r < 0.4:
        return rnd.choice((rnd.randint(-(2**70), 2**70), rnd.randint(-5, 5), rnd.uniform(-1e6, 1e6)))
    return rnd.choice(JSON_VALUES)


def mutate_json_fields(obj: dict[str, Any], rnd: random.Random) -> dict[str, Any]:
    """``obj`` with 1-3 fields replaced, deleted or added."""
    out = dict(obj)
    for _ in range(rnd.randint(1, 3)):
        keys = list(out)
        r = rnd.random()
        if keys and r < 0.7:
            out[rnd.choice(keys)] = random_json(rnd)
        elif keys and r < 0.85:
            out.pop(rnd.choice(keys))
        else:
            out[rnd.choice(["zz", "v", "kind", "", "__proto__"])] = random_json(rnd)
    return out


# -- targets ----------------------------------------------------------------------------
@dataclass
class Target:
    """One decoder: ``decode(bytes)`` must return or raise one of ``allowed``."""

    name: str
    decode: Callable[[bytes], Any]
    allowed: tuple[type[BaseException], ...]
    seeds: list[bytes]
    structured: Callable[[random.Random], bytes] | None = None
    promise: str = ""

    def input(self, rnd: random.Random) -> bytes:
        if self.structured is not None and rnd.random() < 0.4:
            return self.structured(rnd)
        return mutate(rnd.choice(self.seeds), rnd, self.seeds)


@dataclass
class Finding:
    target: str
    kind: str  # "crash" (an undocumented exception) or "hang"
    error: str
    data: bytes
    trace: str = ""


class Workdir:
    """A scratch folder whose file a file-reading decoder reads; rewritten per input."""

    def __init__(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="ioft-fuzz-")
        self.root = Path(self._tmp.name)

    def write(self, name: str, data: bytes) -> Path:
        path = self.root / name
        path.write_bytes(data)
        return path

    def close(self) -> None:
        self._tmp.cleanup()


def _wire_targets() -> list[Target]:
    from safetensors.numpy import save as st_save

    from ioft_protocol import codec, model_push, round_messages, topics

    rng = np.random.default_rng(0)
    params = {"decoder.weight": rng.standard_normal((2, 3)).astype(np.float32), "b": np.zeros(2, np.float32)}
    up = round_messages.UpdateMessage(
        "plant", "speed", "printer1", 3, "train", 45, "ab" * 32, {"loss": 0.5}, params
    )
    ann = round_messages.Announcement(
        "plant", "speed", 3, "train", '{"name": "speed"}', 1.7e9, "cd" * 32, params=params,
        personalized=("printer2",), participants=("printer1", "printer2"),
    )  # fmt: skip
    ann_dev = replace(ann, for_device="printer2", params_hash="ef" * 32)
    offer = model_push.ModelOffer(
        "enc", '{"name": "enc"}', "0a" * 64, 4, ("11" * 32, "22" * 32), ("printer1",), 1.7e9
    )
    chunk = model_push.ModelChunk("enc", 2, 1, b"\x00onnx\xff" * 10, transfer="33" * 32)

    def resave(payload: bytes, rnd: random.Random) -> bytes:
        """A well-formed safetensors payload whose ``ioft`` metadata has mutated fields."""
        meta, tensors = codec.decode(payload)
        meta = mutate_json_fields(meta, rnd)
        if rnd.random() < 0.2 and tensors:  # a tensor of another dtype or shape
            name = rnd.choice(list(tensors))
            tensors = {**tensors, name: rnd.choice([np.zeros(3, np.int64), np.zeros((0,), np.float32),
                                                    np.full(2, np.nan, np.float64), np.zeros((1, 1, 1), np.float16)])}  # fmt: skip
        return st_save(tensors, metadata={"ioft": json.dumps(meta)})

    def chunk_structured(rnd: random.Random) -> bytes:
        meta = {"v": 1, "kind": "model_chunk", "name": "enc", "version": 2, "index": 1, "transfer": "33" * 32}
        data = bytes(rnd.randrange(256) for _ in range(rnd.randint(0, 40)))
        meta["sha256"] = hashlib.sha256(data).hexdigest()
        meta = mutate_json_fields(meta, rnd) if rnd.random() < 0.8 else meta
        arr = np.frombuffer(data, dtype=np.uint8)
        if rnd.random() < 0.2:
            arr = arr.astype(rnd.choice([np.int8, np.float32]))
        return st_save({"data": arr}, metadata={"ioft": json.dumps(meta)})

    allowed = (codec.WireError,)
    promise = "WireError"
    return [
        Target("round_messages.UpdateMessage.decode", lambda b: round_messages.UpdateMessage.decode(b, max_bytes=MAX_INPUT),
               allowed, [up.encode(), ann.encode()], lambda r: resave(up.encode(), r), promise),
        Target("round_messages.Announcement.decode", lambda b: round_messages.Announcement.decode(b, max_bytes=MAX_INPUT),
               allowed, [ann.encode(), ann_dev.encode(), up.encode()],
               lambda r: resave(r.choice([ann, ann_dev]).encode(), r), promise),
        Target("model_push.ModelOffer.decode", lambda b: model_push.ModelOffer.decode(b, max_bytes=MAX_INPUT),
               allowed, [offer.encode()], lambda r: resave(offer.encode(), r), promise),
        Target("model_push.ModelChunk.decode", lambda b: model_push.ModelChunk.decode(b, max_bytes=MAX_INPUT),
               allowed, [chunk.encode()], chunk_structured, promise),
        Target("topics.parse_topic", lambda b: topics.parse_topic(b.decode("utf-8", "replace")), allowed,
               [topics.topic_up("plant", "speed", "printer1").encode(), topics.topic_model_chunk("plant", "enc", 2, 7).encode(),
                topics.topic_down_device("plant", "speed", "printer2").encode(), topics.topic_status("plant", "p1").encode()],
               None, promise),
    ]  # fmt: skip


def _transfer_target(work: Workdir) -> Target:
    """A fuzzed chunk through ``ModelChunk.decode`` and ``Transfer.accept`` (the device's path)."""
    from edge.models.transfer import RefusedError, Transfer
    from ioft_protocol import codec, model_push
    from ioft_protocol.manifest import ModelIOSpec, ModelManifest

    blob = bytes(range(256)) * 2
    size = 128
    pieces = [blob[i : i + size] for i in range(0, len(blob), size)]
    hashes = tuple(hashlib.sha256(p).hexdigest() for p in pieces)
    offer = model_push.ModelOffer("enc", "{}", "0a" * 64, size, hashes)
    manifest = ModelManifest(
        "enc", 2, "embedding", ModelIOSpec("x", (None, 4)), ModelIOSpec("z", (None, 2)), "ab" * 32,
        hashlib.sha256(blob).hexdigest(), len(blob), 17, 8, {}, "2026-01-01T00:00:00+00:00", "0" * 16,
    )  # fmt: skip
    seeds = [
        model_push.ModelChunk("enc", 2, i, p, transfer=offer.transfer).encode() for i, p in enumerate(pieces)
    ]

    def decode(data: bytes) -> Any:
        part = work.root / "model.part"
        part.unlink(missing_ok=True)
        t = Transfer.open(part, offer, manifest, manifest.sha256, now=0.0)
        try:
            return t.accept(model_push.ModelChunk.decode(data, max_bytes=size), now=1.0)
        finally:
            t.close()

    return Target("model_transfer.Transfer.accept", decode, (codec.WireError, RefusedError), seeds, None,
                  "WireError (decode) or RefusedError (accept)")  # fmt: skip


def _manifest_targets() -> list[Target]:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from ioft_protocol.manifest import ManifestError, ModelIOSpec, ModelManifest, verify_manifest

    m = ModelManifest(
        "weld-encoder", 3, "embedding", ModelIOSpec("x", (None, 624)), ModelIOSpec("z", (None, 50)), "ab" * 32,
        "cd" * 32, 557_396, 17, 8, {"max_abs_diff": 1e-6}, "2026-01-01T00:00:00+00:00", "0" * 16,
        quantization="int8-dynamic", extra={"backbone": "cnn"},
    )  # fmt: skip
    text = m.to_json()
    raw = json.loads(text)
    key = Ed25519PrivateKey.generate()
    public = key.public_key()

    def structured(rnd: random.Random) -> bytes:
        obj = mutate_json_fields(raw, rnd)
        if rnd.random() < 0.5:  # reach inside the tensor specs too
            which = rnd.choice(["input", "output"])
            obj[which] = mutate_json_fields(raw[which], rnd) if rnd.random() < 0.8 else random_json(rnd)
        return json.dumps(obj).encode()

    def signed(data: bytes) -> Any:
        """The device's path: signature over the exact text, then parse (fuzz passes the signature)."""
        manifest = data.decode("utf-8", "surrogateescape")
        try:
            sig = key.sign(manifest.encode()).hex()
        except UnicodeEncodeError:
            sig = "00" * 64
        return verify_manifest(manifest, sig, public)

    def from_json(data: bytes) -> Any:
        return ModelManifest.from_json(data.decode("utf-8", "replace"))

    return [
        Target("manifest.ModelManifest.from_json", from_json, (ManifestError,), [text.encode()], structured,
               "ManifestError"),
        Target("manifest.verify_manifest", signed, (ManifestError,), [text.encode()], structured, "ManifestError"),
    ]  # fmt: skip


def _toml_value(rnd: random.Random) -> str:
    return rnd.choice(
        ['""', '"x"', "0", "-1", "1e400", "nan", "inf", "true", "[]", "{}", "[1, \"a\"]", "{ a = 1 }",
         "1979-05-27T07:32:00Z", "9223372036854775807", '"mqtt://a:1"', '"printer1"', "0.5"]
    )  # fmt: skip


def _config_targets(work: Workdir) -> list[Target]:
    from cloud_aggregator.config import AggregatorConfig
    from edge.config import DeviceConfig
    from ioft_protocol.config import ConfigError, build, load_toml

    device = (
        'device = "printer1"\nfleet = "plant"\nbroker = "mqtts://broker:8883"\nstate_dir = "/tmp/x"\n'
        'keepalive = 30\n[data]\nsource = "simulate-printer"\nseed = 4\n'
        '[tls]\nca_file = "ca.pem"\ncert_file = "c.pem"\nkey_file = "k.pem"\n'
    )
    aggregator = (
        'fleet = "plant"\nbroker = "mqtt://127.0.0.1:1883"\nstate_dir = "/tmp/agg"\nallow_plaintext = true\n'
        "max_payload_bytes = 65536\n[collect]\ndeadline_s = 20\nmin_participants = 2\n"
        'expected = ["printer1", "printer2"]\nstraggler = "next_round"\n'
        "[admission]\nmax_norm_ratio = 50.0\nmin_history = 4\nhistory = 64\nmax_update_norm = 1e3\n"
        "max_param_norm = inf\n"
        '[[task]]\nname = "speed"\nalgorithm = "pflda"\nmodel = "sigmoid_glm"\nrounds = 10\n'
        'hparams = { lr = 0.1, local_steps = 10, lam = 0.9 }\nserver = { weighting = "uniform", reducer = "krum", '
        "reducer_args = { f = 1 } }\n"
    )

    def structured(seed_text: str) -> Callable[[random.Random], bytes]:
        lines = seed_text.splitlines()

        def gen(rnd: random.Random) -> bytes:
            out = list(lines)
            for _ in range(rnd.randint(1, 3)):
                i = rnd.randrange(len(out))
                if " = " in out[i]:
                    k = out[i].split(" = ")[0]
                    out[i] = f"{k} = {_toml_value(rnd)}"
                elif rnd.random() < 0.5:
                    out.insert(i, f"{rnd.choice(['bogus', 'seed', 'rounds', 'f'])} = {_toml_value(rnd)}")
            return "\n".join(out).encode()

        return gen

    def loader(cls: type, name: str) -> Callable[[bytes], Any]:
        def decode(data: bytes) -> Any:
            path = work.write(name, data)
            return build(cls, load_toml(path), str(path))

        return decode

    return [
        Target("edge.config (DeviceConfig TOML)", loader(DeviceConfig, "device.toml"), (ConfigError,),
               [device.encode()], structured(device), "ConfigError"),
        Target("cloud_aggregator.config (AggregatorConfig TOML)", loader(AggregatorConfig, "agg.toml"),
               (ConfigError,), [aggregator.encode()], structured(aggregator), "ConfigError"),
    ]  # fmt: skip


def _weld_targets(work: Workdir) -> list[Target]:
    from sensors.welding.formats import read_weld_file, write_weld_file
    from sensors.welding.recording import WeldDataError, WeldRecording
    from sensors.welding.wavfile import read_wav

    rng = np.random.default_rng(1)
    rec = WeldRecording(
        data=rng.standard_normal((2, 64)), channels=("power", "lvdt"), sample_rate=1000.0, weld_id="W0001",
        started_at=datetime(2024, 5, 1, 8, 0, tzinfo=UTC), source="fuzz", meta={}, min_sample_rate=1.0,
    )  # fmt: skip
    seed_dir = work.root / "seeds"
    seed_dir.mkdir()
    files: dict[str, list[bytes]] = {".wav": [], ".npy": [], ".csv": []}
    sidecars: list[bytes] = []
    for i, (suffix, fmt, ext) in enumerate(
        [(".wav", "int16", False), (".wav", "float32", True), (".wav", "int24", True), (".npy", "float32", False),
         (".csv", "float32", False)]
    ):  # fmt: skip
        path = write_weld_file(rec, seed_dir / f"w{i}{suffix}", sample_format=fmt, extensible=ext)
        files[suffix].append(path.read_bytes())
        sidecars.append(path.with_name(path.stem + ".json").read_bytes())
    # A CSV with a time column and comments, no sidecar.
    csv_plain = "# sample_rate: 1000\ntime_s,power,lvdt\n" + "".join(
        f"{i / 1000},{i},{-i}\n" for i in range(20)
    )
    files[".csv"].append(csv_plain.encode())
    allowed = (WeldDataError,)

    def read(suffix: str, sidecar: bytes | None) -> Callable[[bytes], Any]:
        def decode(data: bytes) -> Any:
            side = work.root / "weld.json"
            if sidecar is None:
                side.unlink(missing_ok=True)
            else:
                side.write_bytes(sidecar)
            return read_weld_file(work.write("weld" + suffix, data), min_sample_rate=1.0)

        return decode

    side_npy = sidecars[3]

    def sidecar_target(data_file: bytes, suffix: str) -> Callable[[bytes], Any]:
        def decode(data: bytes) -> Any:
            work.write("weld.json", data)
            return read_weld_file(work.write("weld" + suffix, data_file), min_sample_rate=1.0)

        return decode

    def side_structured(rnd: random.Random) -> bytes:
        obj = mutate_json_fields(json.loads(rnd.choice(sidecars)), rnd)
        if rnd.random() < 0.3:
            obj["scale"] = mutate_json_fields({"power": 2.0, "lvdt": 0.5}, rnd)
        return json.dumps(obj).encode()

    def npy_structured(rnd: random.Random) -> bytes:
        """A real .npy of random dtype and shape (header mutated half the time)."""
        dtype = rnd.choice(["<f4", "<f8", "<i2", ">i4", "|u1", "<c8", "|b1", "<M8[s]", "<U3", "|V4"])
        shape = tuple(rnd.randint(0, 4) for _ in range(rnd.randint(0, 3)))
        buf = io.BytesIO()
        np.save(buf, np.zeros(shape, dtype=dtype), allow_pickle=False)
        data = buf.getvalue()
        return mutate(data, rnd, []) if rnd.random() < 0.5 else data

    return [
        Target("welding WAV (read_wav)", lambda b: read_wav(work.write("x.wav", b)), allowed, files[".wav"], None,
               "WeldDataError (incl. IncompleteWeldFileError)"),
        Target("welding WAV + sidecar (read_weld_file)", read(".wav", sidecars[0]), allowed, files[".wav"], None,
               "WeldDataError"),
        Target("welding NPY + sidecar (read_weld_file)", read(".npy", side_npy), allowed, files[".npy"],
               npy_structured, "WeldDataError"),
        Target("welding CSV (read_weld_file)", read(".csv", None), allowed, files[".csv"], None, "WeldDataError"),
        Target("welding sidecar JSON (NPY)", sidecar_target(files[".npy"][0], ".npy"), allowed, [side_npy],
               side_structured, "WeldDataError"),
        Target("welding sidecar JSON (WAV)", sidecar_target(files[".wav"][0], ".wav"), allowed, sidecars[:3],
               side_structured, "WeldDataError"),
    ]  # fmt: skip


def _label_targets(work: Workdir) -> list[Target]:
    from sensors.welding.labels import LabelLog, LabelLogError

    csv_log = (
        "# maintenance log\ntime,weld_id,tool,horn,anvil,surface,note\n"
        "2024-05-01T08:00:00Z,,TC1,,,clean,new horn\n2024-05-01T10:00:00Z,,,,worn,,knurl worn\n"
        ",W0077,,,,contam,dropped\n2024-05-01T13:00:00+02:00,,,damaged,,,crack\n"
    )
    rows = [
        {"time": "2024-05-01T08:00:00Z", "tool": "new", "surface": "clean"},
        {"weld_id": "W0077", "horn": "worn", "anvil": "new"},
        {"timestamp": "2024-05-01 09:00", "tool": "TC4", "note": "x"},
    ]
    jsonl = "\n".join(json.dumps(r) for r in rows) + "\n"

    def structured(rnd: random.Random) -> bytes:
        return ("\n".join(json.dumps(mutate_json_fields(r, rnd)) for r in rows) + "\n").encode()

    def load(suffix: str) -> Callable[[bytes], Any]:
        def decode(data: bytes) -> Any:
            return LabelLog.load(work.write("labels" + suffix, data))

        return decode

    return [
        Target("welding label log CSV", load(".csv"), (LabelLogError,), [csv_log.encode()], None, "LabelLogError"),
        Target("welding label log JSONL", load(".jsonl"), (LabelLogError,), [jsonl.encode()], structured,
               "LabelLogError"),
    ]  # fmt: skip


def _printer_target(work: Workdir) -> Target:
    from sensors.printer_data import load_printer_runs

    folder = work.root / "printers"
    folder.mkdir()
    seed = "speed,sigma_ax,sigma_ay\n" + "".join(f"30,{0.1 * i:.3f},{0.2 * i:.3f}\n" for i in range(1, 15))

    def decode(data: bytes) -> Any:
        (folder / "FL_Dataset_Printer1_Speed30.csv").write_bytes(data)
        return load_printer_runs(folder)

    # np.loadtxt's errors are ValueError (UnicodeDecodeError is one too).
    return Target(
        "printer data CSV (load_printer_runs)", decode, (ValueError,), [seed.encode()], None, "ValueError"
    )


def _moonraker_target() -> Target:
    """Moonraker's ``/printer/objects/query`` answer, as ``MoonrakerContext.poll`` parses it."""
    from sensors.context.moonraker import MoonrakerError, parse_status

    status = {
        "gcode_move": {"speed": 3000.0, "speed_factor": 1.0, "gcode_position": [10.0, 20.0, 0.6, 5.0]},
        "print_stats": {"state": "printing", "filename": "cube.gcode", "info": {"total_layer": None, "current_layer": 3}},
        "toolhead": {"position": [10.0, 20.0, 0.6, 5.0]},
        "motion_report": {"live_velocity": 31.5},
    }  # fmt: skip
    seeds = [
        json.dumps({"result": {"eventtime": 12345.6, "status": status}}).encode(),
        json.dumps({"eventtime": 1.0, "status": {"print_stats": {"state": "paused"}}}).encode(),
        json.dumps({"result": {"status": {"print_stats": {"state": "standby"}, "toolhead": {"position": [0, 0, 1.4, 0]}}}}).encode(),
    ]  # fmt: skip

    def structured(rnd: random.Random) -> bytes:
        st = {k: dict(v) for k, v in status.items()}
        for _ in range(rnd.randint(1, 3)):
            name = rnd.choice(list(st))
            r = rnd.random()
            if r < 0.25 or not isinstance(st[name], dict):  # an object that is not an object
                st[name] = random_json(rnd)
                continue
            st[name] = dict(st[name])  # random_json may have put a shared JSON_VALUES dict there
            if r < 0.5 and name == "print_stats":  # reach inside info
                st[name]["info"] = mutate_json_fields({"total_layer": None, "current_layer": 3}, rnd)
            elif r < 0.6 and name in ("gcode_move", "toolhead"):
                key = "gcode_position" if name == "gcode_move" else "position"
                st[name][key] = [random_json(rnd) for _ in range(rnd.randint(0, 5))]
            else:
                st[name] = mutate_json_fields(st[name], rnd)
        doc: Any = {"result": {"eventtime": 1.0, "status": st}}
        if rnd.random() < 0.1:
            doc = mutate_json_fields(doc["result"], rnd)
        return json.dumps(doc).encode()

    return Target("moonraker.parse_status", lambda b: parse_status(b, 0.0), (MoonrakerError,), seeds, structured,
                  "MoonrakerError")  # fmt: skip


def _klipper_target() -> Target:
    """Bytes from Klipper's API socket (0x03-framed JSON), as ``KlipperAccelSource`` decodes them."""
    from sensors.accel.klipper import TEMPLATE_KEY, TERMINATOR, KlipperAccelSource

    def frame(obj: Any) -> bytes:
        return json.dumps(obj).encode() + TERMINATOR

    header = {"header": ["time", "x_acceleration", "y_acceleration", "z_acceleration"]}
    batch = {
        "data": [[12.0 + i / 3200, 100.0 * i, -50.0, 9806.65] for i in range(4)],
        "errors": 0,
        "overflows": 0,
    }
    seeds = [
        frame({"id": 1, "result": header}) + frame({TEMPLATE_KEY: "adxl345", "params": batch}),
        frame({TEMPLATE_KEY: "adxl345", "params": {**batch, "errors": 2, "overflows": 1}}) + b'{"ioft_ac',
        frame({"id": 1, "error": {"error": "WebRequestError", "message": "Unknown sensor 'x'"}}),
    ]  # fmt: skip

    def structured(rnd: random.Random) -> bytes:
        out = b""
        for _ in range(rnd.randint(1, 4)):
            params = mutate_json_fields(dict(batch), rnd)
            if rnd.random() < 0.3:
                params["data"] = [
                    [random_json(rnd) for _ in range(rnd.randint(0, 5))] for _ in range(rnd.randint(0, 3))
                ]
            msg: Any = {TEMPLATE_KEY: rnd.choice(["adxl345", "adxl345", "other"]), "params": params}
            if rnd.random() < 0.15:
                msg = {"id": 1, rnd.choice(["result", "error"]): random_json(rnd)}
            elif rnd.random() < 0.1:
                msg = random_json(rnd)
            out += frame(msg)
        return out

    def decode(data: bytes) -> None:
        src = KlipperAccelSource("/nonexistent/klippy_uds", "adxl345", clock=lambda: 100.0)
        src._sub_id = 1  # as after connecting: request 1 was the subscription
        half = len(data) // 2  # in two reads, so a frame torn across them is exercised
        src.decode(data[:half])
        src.decode(data[half:])
        src.status()

    return Target("klipper API socket stream (KlipperAccelSource.decode)", decode, (), seeds, structured,
                  "nothing (bad frames are counted)")  # fmt: skip


def _fleet_status_target() -> Target:
    """A retained device status through ``fleet status``: decode, summarize, format; only ValueError
    from decoding (the status is then skipped), never an error from the table."""
    from cloud_aggregator.console.fleet_status import decode_status, format_table, summarize

    good = {
        "device": "printer1", "state": "online", "time": 1.7e9,
        "tasks": {"speed": {"round": 4, "metrics": {"test_loss": 0.25}}, "weld": {"round": None, "metrics": {}}},
        "models": {"enc": {"active": 3, "previous": 2, "transfer": {"version": 4, "have": 2, "of": 9},
                           "rejected": [{"version": 2, "reason": "bad signature", "time": 1.0}]}},
    }  # fmt: skip
    seeds = [json.dumps(good).encode(), json.dumps({"device": "printer2", "state": "offline"}).encode()]

    def structured(rnd: random.Random) -> bytes:
        body = json.loads(json.dumps(good))
        for _ in range(rnd.randint(1, 3)):
            r = rnd.random()
            if r < 0.3:
                body = mutate_json_fields(body, rnd)
            elif r < 0.5 and isinstance(body.get("tasks"), dict):
                body["tasks"] = dict(body["tasks"])  # never edit a shared JSON_VALUES dict in place
                body["tasks"]["speed"] = mutate_json_fields(good["tasks"]["speed"], rnd)
                body["tasks"]["speed"]["metrics"] = mutate_json_fields({"test_loss": 0.25}, rnd)
            elif r < 0.8 and isinstance(body.get("models"), dict):
                m = mutate_json_fields(good["models"]["enc"], rnd)
                if rnd.random() < 0.5:
                    m["transfer"] = mutate_json_fields(good["models"]["enc"]["transfer"], rnd)
                if rnd.random() < 0.5:
                    m["rejected"] = [mutate_json_fields(good["models"]["enc"]["rejected"][0], rnd)]
                body["models"] = {**body["models"], rnd.choice(["enc", "x"]): m}
            else:
                body[rnd.choice(["models", "tasks", "state", "time"])] = random_json(rnd)
        return json.dumps(body).encode()

    def decode(data: bytes) -> Any:
        body = decode_status(data)
        rows = summarize({"printer1": body, "printer2": good} if body is not None else {"printer2": good})
        return format_table(rows, now=1.7e9)

    return Target("fleet_status (decode_status + summarize + table)", decode, (ValueError,), seeds, structured,
                  "ValueError (decode_status only)")  # fmt: skip


def _state_target(work: Workdir) -> Target:
    """A device's task state file through ``edge.task_state.load_task_state`` (no ``.prev`` copy)."""
    from edge.task_state import TaskState, load_task_state, save_task_state
    from ioft_protocol.state import StateError, decode_arrays, encode_arrays

    logging.getLogger("ioft_protocol.state").setLevel(logging.CRITICAL)  # one error per corrupt input
    states = [
        TaskState('{"name": "speed"}', {"w": np.linspace(-1, 1, 4), "b": np.zeros(1)}, (5, "train"),
                  {"w": np.ones(4, np.float32)}, {"n_samples": 17, "global_hash": "ab" * 32}, {"test_loss": 0.5}),
        TaskState('{"name": "weld"}', {"U": np.eye(3)}),
    ]  # fmt: skip
    seeds = []
    for i, state in enumerate(states):
        save_task_state(work.root / f"seed{i}.safetensors", state)
        seeds.append((work.root / f"seed{i}.safetensors").read_bytes())

    def structured(rnd: random.Random) -> bytes:
        """Valid checksums around mutated metadata (and tensors), so inputs reach the key checks."""
        arrays, meta = decode_arrays(rnd.choice(seeds))
        meta = mutate_json_fields(meta, rnd)
        if rnd.random() < 0.3 and isinstance(meta.get("upload_meta"), dict):
            meta["upload_meta"] = mutate_json_fields(meta["upload_meta"], rnd)
        if rnd.random() < 0.3:
            meta["answered"] = rnd.choice([[random_json(rnd), random_json(rnd)], random_json(rnd)])
        if rnd.random() < 0.2:
            name = rnd.choice(list(arrays))
            arrays[rnd.choice([name, "upload.zz", "other"])] = rnd.choice(
                [
                    np.zeros(3, np.int64),
                    np.zeros((0,), np.float32),
                    np.full(2, np.nan),
                    np.zeros((1, 1, 1), np.float16),
                ]
            )
        return encode_arrays(arrays, meta)

    def decode(data: bytes) -> Any:
        path = work.write("local.safetensors", data)
        return load_task_state(path)

    return Target(
        "device task state (load_task_state)", decode, (StateError,), seeds, structured, "StateError"
    )


class _StubSession:
    """Just enough of ``MqttSession`` for :class:`MqttFleet`'s receive path."""

    def __init__(self) -> None:
        self.on_connect_hooks: list = []

    def subscribe(self, topic: str, qos: int = 1) -> None:
        pass

    def publish(self, topic, payload, retain=False, timeout=None) -> None:
        pass


def _fleet_target() -> Target:
    """The aggregator's whole receive path (decode, then admission): it must never raise."""
    from safetensors.numpy import save as st_save

    from cloud_aggregator.rounds.types import CollectRequest
    from cloud_aggregator.serve.mqtt_fleet import CollectPolicy, MqttFleet
    from ioft_protocol import codec, round_messages
    from trainer_lite.params import param_hash
    from trainer_lite.task import TaskSpec

    g = {"w": np.linspace(-1, 1, 6, dtype=np.float32), "b": np.zeros(1, np.float32)}
    req = CollectRequest(
        TaskSpec("speed", "fedavg", "sigmoid_glm"), 2, "train", g, param_hash(g), {},
        {n: codec.TensorSpec(tuple(v.shape), v.dtype.name) for n, v in g.items()},
    )  # fmt: skip
    fleet = MqttFleet(_StubSession(), "plant", CollectPolicy(max_payload_bytes=MAX_INPUT))
    logging.getLogger("cloud_aggregator.rounds.ingest").setLevel(logging.ERROR)  # one warning per input
    seeds = [
        round_messages.UpdateMessage("plant", "speed", dev, r, "train", 10, req.global_hash, {}, {n: v + d for n, v in g.items()}).encode()
        for dev, r, d in (("printer1", 2, 0.01), ("printer2", 2, 0.02), ("printer2", 1, 0.02), ("printer3", 3, 0.5), ("printer4", 2, 1e4))
    ]  # fmt: skip

    def structured(rnd: random.Random) -> bytes:
        meta, tensors = codec.decode(rnd.choice(seeds))
        meta = mutate_json_fields(meta, rnd) if rnd.random() < 0.5 else meta
        if rnd.random() < 0.5:
            name = rnd.choice(list(tensors))
            tensors = {**tensors, name: tensors[name] * rnd.choice([np.inf, np.nan, -1e30, 0.0, 1e-30])}
        return st_save(tensors, metadata={"ioft": json.dumps(meta)})

    def decode(data: bytes) -> Any:
        collector = fleet.round_collector(req)  # a round of its own per input: nothing carries over
        fleet.ingest.take(collector, [(rnd_device(data), data, None, False)])
        return collector.inbox

    def rnd_device(data: bytes) -> str:
        """The device the payload names (so inputs get past the identity check), else printer1."""
        try:
            return round_messages.UpdateMessage.decode(data, max_bytes=MAX_INPUT).device
        except codec.WireError:
            return "printer1"

    return Target("mqtt_fleet receive path (decode + admission)", decode, (), seeds, structured, "nothing")


def all_targets(work: Workdir) -> list[Target]:
    return [
        *_wire_targets(),
        _fleet_target(),
        _transfer_target(work),
        *_manifest_targets(),
        *_config_targets(work),
        *_weld_targets(work),
        *_label_targets(work),
        _printer_target(work),
        _moonraker_target(),
        _klipper_target(),
        _fleet_status_target(),
        _state_target(work),
    ]


# -- running ----------------------------------------------------------------------------
class HangError(Exception):
    pass


def _alarm(signum, frame):
    raise HangError


def check_one(target: Target, data: bytes, hang_s: float = 0.0) -> Finding | None:
    """Run one input; a :class:`Finding` if the contract broke."""
    if hang_s > 0:
        signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, hang_s)
    try:
        with np.errstate(all="ignore"):
            target.decode(data)
    except target.allowed:
        return None
    except HangError:
        return Finding(target.name, "hang", f"no answer within {hang_s} s", data)
    except Exception as exc:
        return Finding(
            target.name, "crash", f"{type(exc).__name__}: {exc}"[:300], data, traceback.format_exc()
        )
    finally:
        if hang_s > 0:
            signal.setitimer(signal.ITIMER_REAL, 0)
    return None


@dataclass
class Tally:
    inputs: int = 0
    seconds: float = 0.0
    findings: list[Finding] = field(default_factory=list)


def fuzz(target: Target, n: int, seed: int, hang_s: float) -> Tally:
    rnd = random.Random(f"{seed}:{target.name}")
    tally = Tally()
    t0 = time.perf_counter()
    for seed_input in target.seeds:  # the seeds themselves must decode
        if (f := check_one(target, seed_input, hang_s)) is not None:
            tally.findings.append(f)
    for _ in range(n):
        data = target.input(rnd)
        f = check_one(target, data, hang_s)
        tally.inputs += 1
        if f is not None:
            tally.findings.append(f)
    tally.seconds = time.perf_counter() - t0
    return tally


#: What earlier runs found (kept in the results file, which each full run rewrites).
HISTORY = """## Crashes found earlier

The first run (200–300 inputs per decoder, before the fixes in commit ce030f4, regression tests in
tests/ioft_protocol/test_manifest_regressions.py, tests/sensors/test_decoder_regressions.py) broke the contract in six decoders:

- `manifest.verify_manifest`: `UnicodeEncodeError` for a manifest holding a lone surrogate (a hostile offer's JSON can carry `"\\udc80"`); `ModelManifest.from_dict`: `AttributeError` when `parity`/`extra` is not an object. `edge/models.py` catches only `ManifestError`. Now `ManifestError`.
- `read_weld_file` (sidecars): `TypeError`/`ValueError` from `channels`, `sample_rate`, `scale` of the wrong type; `tokenize.TokenError` from a corrupt NPY header; `UnicodeDecodeError` from CSV files and sidecars; complex NPY arrays were silently cast to real. Now `WeldDataError`.
- `LabelLog.load`: `UnicodeDecodeError` for non-UTF-8 logs. Now `LabelLogError`.

The Moonraker, fleet-status and device-state targets were added later, with their fixes
(commits d082e4a, 7f141b7, ffaa2e6; tests in tests/sensors/test_context_moonraker.py,
tests/cloud_aggregator/test_fleet_status.py, tests/ioft_protocol/test_state.py).  Against the code before those
fixes, 3000 of each target's inputs (seed 0) gave 240 contract breaks in `parse_status` (all
`AttributeError`: a status object that is not an object) and 654 in `summarize` (350
`AttributeError`, 196 `TypeError`, 85 `KeyError`, 23 `ValueError` on ill-typed fields); `load_task_state`
raised `KeyError` for a checksummed file without `spec`, and edited metadata passed the
tensor-only checksum.
"""


def main(argv: list[str] | None = None) -> int:
    parser = study_parser(__doc__.split("\n")[0], default_seeds=(0,))
    parser.add_argument("--examples", type=int, default=5000, help="inputs per decoder (quick: 300)")
    parser.add_argument("--hang-s", type=float, default=2.0, help="an input slower than this is a hang")
    parser.add_argument("--only", default="", help="run only decoders whose name contains this")
    args = parser.parse_args(argv)
    n = 300 if args.quick else args.examples
    work = Workdir()
    t0 = time.time()
    try:
        targets = [t for t in all_targets(work) if args.only in t.name]
        tallies: dict[str, Tally] = {t.name: Tally() for t in targets}
        for seed in args.seeds:
            for target in progress(targets, f"seed {seed}"):
                tally = fuzz(target, n, seed, args.hang_s)
                agg = tallies[target.name]
                agg.inputs += tally.inputs
                agg.seconds += tally.seconds
                agg.findings += tally.findings
    finally:
        work.close()
    wall = time.time() - t0
    rows = []
    for t in targets:
        tl = tallies[t.name]
        crashes = sum(f.kind == "crash" for f in tl.findings)
        hangs = sum(f.kind == "hang" for f in tl.findings)
        rows.append(
            [t.name, t.promise, tl.inputs, f"{tl.inputs / max(tl.seconds, 1e-9):.0f}", crashes, hangs]
        )
    total = sum(tl.inputs for tl in tallies.values())
    found = [f for tl in tallies.values() for f in tl.findings]
    table = markdown_table(["decoder", "may raise", "inputs", "inputs/s", "crashes", "hangs"], rows)
    print(table)
    body = (
        f"{total} inputs over {len(targets)} decoders (seeds {args.seeds}, {n} per decoder per seed, "
        f"~40% structured where a generator exists), hang limit {args.hang_s} s, wall {wall:.0f} s, "
        f"peak RSS {peak_rss_mb():.0f} MiB. Findings: {len(found)}.\n\n{table}\n"
    )
    body += (
        "\nInputs come from a seeded `random.Random` mutator (byte mutations of valid seeds plus "
        "structured generators), not a coverage-guided fuzzer; hypothesis drives the same generators "
        "in `tests/checks/test_fuzz_decoders_quick.py` on a budget of seconds.\n"
    )
    for f in found[:20]:
        body += f"\n### {f.kind} in {f.target}\n\n`{f.error}`\n\ninput (hex, first 200 bytes): `{f.data[:200].hex()}`\n"
        print(f"{f.kind} in {f.target}: {f.error}\n{f.trace}", file=sys.stderr)
    if not args.no_write:
        if not args.quick and not args.only:
            body += "\n" + HISTORY
        name = "fuzz_decoders" + ("_quick" if args.quick else "")
        command = "python -m checks.fuzz_decoders " + " ".join(argv if argv is not None else sys.argv[1:])
        path = write_result(name, body, command=command, folder=RESULTS)
        print(f"wrote {path}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
