"""``edge-recorder`` (:mod:`edge.recording.cli`): fills the device's local dataset from the machine's real sensors.

A second long-running process beside ``edge-trainer``, so that recording is never
held up by training (and a training round never waits for a sensor).  It reads the
``[sensors]`` table of the device's TOML (:class:`edge.config_sensors.SensorsConfig`) and
appends rows to the dataset the trainer trains on, ``<state_dir>/dataset.segments/``
(:mod:`edge.segments`): each stored batch is one new segment written atomically (temp
file, fsync, rename, fsync folder), never a rewrite of the rows already stored; small
segments are merged behind it.  A dataset of an older version (the single file
``dataset.safetensors``) is appended to as is: it stays, read as the oldest segment.

Printer (:class:`PrinterRecorder`)
    The accelerometer (ADXL345 / MPU-6050 on ``/dev/i2c-N`` through smbus2, or
    Klipper's stream) runs under :class:`~sensors.accel.supervisor.Supervisor`: a bus
    error, a wrong chip, a stuck or saturated axis or a FIFO overrun puts it into a
    reported fault state with retry and backoff, and the samples of that batch never
    reach a layer.  A missing bus (no ``/dev/i2c-1`` -- I2C not enabled) is such a
    fault too: logged with what to do, retried with backoff.  Moonraker is polled
    every ``poll_s`` on its own thread (a hung printer costs a timeout there, never a
    FIFO overrun here).  Both feed a :class:`~sensors.context.recorder.LayerRecorder`,
    which emits one PFL-DA §4.3 row per completed layer and drops (and counts) every
    layer a fault touched.  Each row is stored as ``x = sigma_a``, ``y = speed / 50``
    (:func:`sensors.layers.to_xy`), the form the simulated printers and the real data
    set have.
Welder (:class:`WelderRecorder`)
    Welds from the watched folder (:class:`~sensors.welding.folder.WatchedFolderSource`:
    marker or settle time, a ledger so a weld is delivered at most once, bad files set
    aside), the 624 DWT features of :data:`~sensors.features.schema.DEFAULT_SCHEMA`,
    labels from the operator/maintenance log for the configured task.  ``y`` is the
    class index into ``meta["classes"]``; the feature schema's hash is in
    ``meta["schema_hash"]`` and an existing dataset of another schema is refused.  A
    weld the log does not label yet waits in ``weld-pending.safetensors`` and is stored
    once the log (re-read when it changes) labels it.

Train/test split (deterministic, documented)
    A unit -- a print run (``split = "run"``, the default for printers: layers of one
    run are correlated, so a held-out run is an honest test), a layer (``"layer"``) or
    a weld (``"weld"``) -- goes to **test** when ``sha256(device NUL key)``, read as a
    fraction in [0, 1), is below ``test_fraction``, else to train; except that while the
    train split is empty every new unit goes to train, so the trainer always has rows
    to train on.  Keys: ``"<job>#<run>"`` for a run, ``"<job>#<run>/<layer>"`` for a
    layer, the weld id for a weld.  ``<run>`` numbers the print runs this device has
    recorded (persisted in the dataset's metadata): a new run starts when the job name
    changes or the layer number does not increase.  The same unit always lands in the
    same split, also across restarts.

Serving: every row is also handed at once to ``edge-trainer``'s serving model through the row
feed (:mod:`edge.feed`) -- a layer as it is stored, a weld as soon as its features
exist, labelled or not -- so the machine's own model answers it (:mod:`edge.serving`).

Reporting: faults are logged as they happen and ``<state_dir>/recorder-status.json``
(written atomically every ``status_every_s`` and on exit) holds the sensor and
context status, row counts and the drop counts by reason.  SIGTERM/SIGINT end the
loop after the current step; the pending layers are finalized (only if the samples
cover them), stored, and the sensors put in standby.  Every write is atomic, so the
dataset is consistent whenever the process dies: it holds every batch whose flush
returned, each row once.

Welds are delivered at most once (the folder source's ledger records a weld before
handing it over): a crash between delivery and the dataset write loses that weld's
row, never duplicates it; its file stays in the folder.
"""
