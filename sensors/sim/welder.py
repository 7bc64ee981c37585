"""Simulated ultrasonic metal welds: four channels whose spectra follow tool, surface, material and weld time.

Built to stand in for FTL-TP's data set (§3.2, Table 1): domain group **M** (four
material pairs, 0.5/0.9 s, tool classes TC1-TC4), **S** (Cu-Cu 1.0 s, surface domains
clean/polished/contaminated, tool classes New/Worn/DMGD) and **T** (the S signals,
labelled by surface, domains = tool condition).  Classes are separable within a
domain; domains shift the feature distribution so that a model trained on one loses
accuracy on another (``tests/sensors/test_welder_sim.py`` checks both).

What is physics (directions and orders of magnitude from the UMW literature):

* a ~20 kHz ultrasonic carrier; the power supply tracks the stack's resonance, which
  moves by tens of Hz with load and tool mass (worn horn: mass lost, frequency up;
  cracked horn: stiffness lost, frequency down);
* harmonics of the carrier from the nonlinear horn-workpiece contact, stronger when the
  knurl is worn; a subharmonic (f0/2) from a cracked, rattling tool;
* the power curve: a ramp-up of tens of ms, a plateau set by the material pair (copper
  needs more power than aluminium), a bump as the interface bonds, and instantaneous
  power rippling at 2 f0;
* the LVDT indentation profile: the horn sinks into the top sheet after an onset
  delay, approaching a depth that is larger for soft aluminium, with a time constant;
* acoustic emission bursts (decaying tone bursts at tens of kHz, where AE sensors
  resonate) from friction, slip and oxide fracture, concentrated early in the weld;
  more slip when the knurl grips less (worn tools, cutting fluid on the surface);
* stick-slip oscillation of a few hundred Hz in power and displacement when the anvil
  no longer holds the bottom sheet;
* knurl chatter: a worn or cracked knurl no longer locks into the sheet, and the
  horn-tip / sheet contact rings at its contact resonance, ``f_c ∝ √(k_contact / m)``.
  The contact stiffness follows the sheets' elastic moduli (copper ~117 GPa, aluminium
  ~70 GPa; the top sheet, which the horn touches, most) and the interface: a cutting-
  fluid film softens the contact (lower ``f_c``), sanding leaves stiffer asperities
  (higher).  So the tool's signature sits in a frequency band that *moves with the
  domain*: on an aluminium-topped pair in the 6-12 kHz DWT band, on a copper-topped
  pair in the 12-25 kHz band (beside the carrier), and a contaminated surface moves it
  down a band.  This is a shift of *where* the signature is, which no per-feature
  offset and gain (a z-score) undoes.

What is invented: every number in :data:`MATERIALS`, :data:`TOOL_GRIP`,
:data:`SURFACE_PROPS` and the formulas combining them; the burst statistics; the
sensor gains and noise; the contact-resonance frequencies (``Material.contact_hz``,
``Surface.contact``: only their ordering, copper above aluminium, fluid film below
dry, comes from the physics above) and the chatter's amplitude and bandwidth.  They are
set by eye so that class and domain effects have comparable size, not fitted to any
measurement, and not tuned toward any learning method: the contact frequencies were
chosen from the moduli ordering and the DWT octave edges (12.5 kHz at 200 kHz sampling)
before any study was run on them.

Components above 0.45 fs are left out (as a DAQ's anti-alias filter would remove
them).  ``time_scale < 1`` compresses the weld's slow dynamics (ramp, indentation,
stick-slip, burst timing) into a shorter signal for fast studies; carrier and burst
frequencies are unchanged.  ``time_scale=0.3`` keeps the shortest (0.5 s) welds above
the default schema's 28,672-sample minimum at 200 kHz.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

import numpy as np

from sensors.welding.recording import WELD_CHANNELS, WeldRecording

CARRIER_HZ = 20_000.0
TOOL_STATES = ("new", "worn", "damaged")
SURFACES = ("clean", "polished", "contaminated")


@dataclass(frozen=True)
class Material:
    """Invented properties of one sheet pair (top-bottom)."""

    power_kw: float  # plateau electrical power
    depth_mm: float  # final indentation
    tau: float  # indentation time constant, fraction of the weld time
    slip_hz: float  # stick-slip frequency
    ae_band: tuple[float, float]  # AE burst centre frequencies
    bursts: float  # mean AE burst count per weld
    harmonic: float  # baseline 2nd-harmonic ratio of the carrier
    mic_gain: float
    ae_gain: float
    f_shift: float  # resonance shift under this load, Hz
    horn_sens: float  # how strongly horn wear shows in harmonics and AE (knurl marks vs sheet)
    anvil_sens: float  # how strongly anvil wear shows in stick-slip and power
    contact_hz: float  # contact resonance of the horn tip on this pair: where knurl chatter rings


MATERIALS: dict[str, Material] = {
    # contact_hz: aluminium on top (the horn's side) below the 12.5 kHz DWT band edge, copper above
    "Al-Cu": Material(2.2, 0.100, 0.22, 190.0, (35e3, 75e3), 40.0, 0.10, 1.00, 1.00, -10.0, 1.0, 0.6, 10.0e3),
    "Cu-Cu": Material(3.0, 0.070, 0.30, 270.0, (45e3, 92e3), 55.0, 0.16, 1.25, 1.40, -30.0, 1.3, 1.0, 16.0e3),
    "Cu-Al": Material(2.6, 0.085, 0.26, 230.0, (40e3, 85e3), 48.0, 0.13, 1.10, 1.20, -20.0, 0.8, 1.4, 14.0e3),
    "Al-Al": Material(1.6, 0.120, 0.18, 160.0, (30e3, 65e3), 32.0, 0.08, 0.85, 0.80, 0.0, 0.5, 1.2, 8.0e3),
}
#: How well a tool's knurl grips the sheet it touches.
TOOL_GRIP = {"new": 1.0, "worn": 0.72, "damaged": 0.5}


@dataclass(frozen=True)
class Surface:
    """Invented effects of a workpiece surface preparation."""

    friction: float  # interface friction relative to clean
    burst_rate: float  # oxide-fracture AE bursts relative to clean
    burst_freq: float  # AE burst frequency scale (sanding asperities ring lower)
    onset: float  # extra indentation onset delay, fraction of the weld time
    power: float  # plateau power scale
    contact: float  # contact resonance scale (a fluid film softens the contact, asperities stiffen it)


#: Clean = alcohol-wiped, polished = sandpapered (oxide removed, asperities left),
#: contaminated = cutting fluid (lubricates: slip, delayed bonding).
SURFACE_PROPS: dict[str, Surface] = {
    "clean": Surface(1.0, 1.0, 1.0, 0.0, 1.0, 1.0),
    "polished": Surface(1.12, 0.6, 0.75, -0.02, 1.06, 1.15),
    "contaminated": Surface(0.7, 1.3, 0.9, 0.08, 0.92, 0.7),
}
#: FTL-TP domain group M: material domains and their weld times (Table 1a).
GROUP_M_DOMAINS = (("Al-Cu", 0.5), ("Cu-Cu", 0.9), ("Cu-Al", 0.5), ("Al-Al", 0.9))
GROUP_M_CLASSES = (
    ("TC1", ("new", "new")),
    ("TC2", ("new", "worn")),
    ("TC3", ("worn", "new")),
    ("TC4", ("worn", "worn")),
)
GROUP_S_CLASSES = (("New", ("new", "new")), ("Worn", ("worn", "worn")), ("DMGD", ("damaged", "damaged")))
GROUP_S_DOMAINS = ("clean", "polished", "contaminated")
GROUP_S_MATERIAL, GROUP_S_TIME = "Cu-Cu", 1.0


@dataclass(frozen=True)
class WeldCondition:
    """The process configuration of one simulated weld."""

    horn: str = "new"
    anvil: str = "new"
    surface: str = "clean"
    material: str = "Cu-Cu"
    weld_time: float = 0.5

    def __post_init__(self) -> None:
        errors = []
        for name, value, choices in (
            ("horn", self.horn, TOOL_STATES),
            ("anvil", self.anvil, TOOL_STATES),
            ("surface", self.surface, SURFACES),
            ("material", self.material, tuple(MATERIALS)),
        ):
            if value not in choices:
                errors.append(f"{name}={value!r} not in {choices}")
        if not 0.05 <= self.weld_time <= 5.0:
            errors.append(f"weld_time={self.weld_time} s outside 0.05..5 s")
        if errors:
            raise ValueError("invalid WeldCondition: " + "; ".join(errors))


def _smooth(x: np.ndarray, width: int) -> np.ndarray:
    """Moving average (a cheap low-pass) of ``x`` over ``width`` samples, same length."""
    if width <= 1:
        return x
    c = np.cumsum(np.concatenate([np.zeros(1), x]))
    out = (c[width:] - c[:-width]) / width
    return np.concatenate([np.full(width - 1, out[0]), out])


def simulate_weld(
    condition: WeldCondition,
    rng: np.random.Generator,
    *,
    sample_rate: float = 200_000.0,
    time_scale: float = 1.0,
    weld_id: str = "sim-0",
    started_at: datetime | None = None,
) -> WeldRecording:
    """One weld's four channels (power kW, LVDT mm, AE V, microphone Pa-ish).

    Parameters
    ----------
    condition
        Tool, surface, material and weld time.
    rng
        The randomness of this weld (sheet variation, bursts, noise, phases).
    sample_rate
        Samples per second; below 200 kHz the recording is marked as deliberately slow.
    time_scale
        Compress the weld's duration by this factor (see module docstring).
    weld_id, started_at
        Recording metadata.
    """
    if not 0.05 <= time_scale <= 1.0:
        raise ValueError(f"time_scale must be in 0.05..1.0; got {time_scale}")
    # The steps draw from ``rng`` in this order; reordering them changes every weld.
    w = _weld(condition, rng, float(sample_rate), time_scale)
    power, envelope, f_ss = _power(w, rng)
    lvdt = _lvdt(w, f_ss)
    ae = _acoustic_emission(w, envelope, rng)
    mic = _microphone(w, envelope, rng)
    _knurl_chatter(w, envelope, f_ss, ae, mic, rng)
    mic += 0.05 * _smooth(w.noise[3], max(1, int(w.fs / 1500))) * 10 + 0.01 * w.noise[3]
    return WeldRecording(
        data=np.stack([power, lvdt, ae, mic]),
        channels=WELD_CHANNELS,
        sample_rate=w.fs,
        weld_id=weld_id,
        started_at=started_at or datetime(2024, 1, 1, tzinfo=UTC),
        source="sim",
        meta={**asdict(condition), "time_scale": time_scale},  # horn, anvil, surface, material, weld_time
        min_sample_rate=min(w.fs, 200_000.0),
    )


@dataclass(frozen=True)
class _Weld:
    """What the four channels of one weld share: time base, material, wear, coupling and carrier."""

    condition: WeldCondition
    mat: Material
    surf: Surface
    fs: float
    time_scale: float
    nyq_ok: float  # components above this are left out (the DAQ's anti-alias filter)
    n: int
    t: np.ndarray
    u: np.ndarray  # normalised weld time 0..1
    g_h: float
    w_h: float
    w_a: float
    sheet: float
    kappa: float
    damaged: int
    noise: np.ndarray
    f0: float
    phase: np.ndarray
    s1: np.ndarray
    c1: np.ndarray
    s2: np.ndarray
    s3: np.ndarray


def _weld(condition: WeldCondition, rng: np.random.Generator, fs: float, time_scale: float) -> _Weld:
    """The weld's time base, this sheet's variation, the tool's coupling and the carrier's phase."""
    nyq_ok = 0.45 * fs
    mat = MATERIALS[condition.material]
    duration = condition.weld_time * time_scale
    n = round(duration * fs)
    t = np.arange(n) / fs
    u = t / duration  # normalised weld time 0..1
    g_h, g_a = TOOL_GRIP[condition.horn], TOOL_GRIP[condition.anvil]
    # Wear as the material pair "sees" it: the same tool shows differently on Al and Cu.
    w_h, w_a = mat.horn_sens * (1 - g_h), mat.anvil_sens * (1 - g_a)
    surf = SURFACE_PROPS[condition.surface]
    fric = surf.friction
    sheet = rng.normal(1.0, 0.04)  # sheet thickness / hardness variation
    kappa = (g_h**0.6) * (g_a**0.4) * fric * rng.normal(1.0, 0.03)  # overall coupling
    damaged = (condition.horn == "damaged") + (condition.anvil == "damaged")
    noise = rng.standard_normal((4, n), dtype=np.float32)  # float32: twice as fast, plenty for noise

    # Carrier phase: resonance shifts with load and horn state, with slow wander.
    f0 = CARRIER_HZ + mat.f_shift + {"new": 0.0, "worn": 25.0, "damaged": -60.0}[condition.horn]
    f0 += rng.normal(0.0, 5.0)
    phase = 2 * np.pi * f0 * t + rng.uniform(0, 2 * np.pi)
    s1, c1 = np.sin(phase), np.cos(phase)
    s2 = 2 * s1 * c1
    s3 = s1 * (3 - 4 * s1 * s1)
    return _Weld(
        condition, mat, surf, fs, time_scale, nyq_ok, n, t, u, g_h, w_h, w_a, sheet, kappa, damaged,
        noise, f0, phase, s1, c1, s2, s3,
    )  # fmt: skip


def _power(w: _Weld, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, float]:
    """Power: ramp, plateau, bonding bump, stick-slip, 2 f0 ripple; with its envelope and slip rate."""
    mat, surf, u, t, kappa, fric, nyq_ok = w.mat, w.surf, w.u, w.t, w.kappa, w.surf.friction, w.nyq_ok
    plateau = mat.power_kw * w.sheet * surf.power * (0.72 + 0.28 * kappa)
    ramp = 1 - np.exp(-u / 0.06)
    u_bond = min(0.85, 0.3 / math.sqrt(max(kappa, 0.2)) + 1.5 * surf.onset)
    bump = 0.15 * kappa * np.exp(-(((u - u_bond) / 0.12) ** 2))
    decline = 1 - 0.1 * np.clip(u - u_bond, 0, None)
    envelope = ramp * (1 + bump) * decline
    slip_amp = 0.10 * w.w_a + 0.06 * max(0.0, 1 - fric) + 0.02
    f_ss = mat.slip_hz * rng.normal(1.0, 0.04) / w.time_scale
    stick_slip = slip_amp * np.sin(2 * np.pi * f_ss * t + rng.uniform(0, 2 * np.pi)) * ramp
    power = plateau * (envelope + stick_slip)
    power += 0.02 * plateau * ramp * (w.c1 * w.c1 - w.s1 * w.s1) if 2 * w.f0 < nyq_ok else 0.0
    power += 0.01 * plateau * _smooth(w.noise[0], max(1, int(w.fs / 2000))) * 8 + 0.004 * plateau * w.noise[0]
    if w.damaged:  # a cracked tool loses contact briefly: power dips
        n = w.n
        for _ in range(int(rng.poisson(3 * w.damaged))):
            c = rng.uniform(0.15, 0.95)
            win = slice(max(0, int((c - 0.04) * n)), min(n, int((c + 0.04) * n)))
            power[win] *= 1 - 0.25 * np.exp(-(((u[win] - c) / 0.01) ** 2))
    return power, envelope, f_ss


def _lvdt(w: _Weld, f_ss: float) -> np.ndarray:
    """LVDT: indentation after an onset delay, stick-slip ripple, low-bandwidth noise."""
    mat, surf, kappa, fric = w.mat, w.surf, w.kappa, w.surf.friction
    depth = mat.depth_mm * w.sheet * (0.55 + 0.45 * (w.g_h**0.8) * min(fric, 1.05))
    onset = 0.04 + 0.10 * (1 - min(kappa, 1.0)) + surf.onset
    tau = mat.tau * (1.2 - 0.2 * kappa)
    rise = np.clip(w.u - onset, 0, None)
    lvdt = depth * (1 - np.exp(-rise / tau))
    lvdt += 0.03 * depth * (w.w_h + 0.3) * np.sin(2 * np.pi * 0.5 * f_ss * w.t) * (rise > 0)
    lvdt += 0.004 * depth * _smooth(w.noise[1], max(1, int(w.fs / 4000))) * 6
    return lvdt


def _acoustic_emission(w: _Weld, envelope: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Acoustic emission: carrier leakage with harmonics, then slip/fracture bursts."""
    mat, surf, kappa, fric, nyq_ok, fs = w.mat, w.surf, w.kappa, w.surf.friction, w.nyq_ok, w.fs
    w_h, w_a, f0, damaged, s1, s2, s3 = w.w_h, w.w_a, w.f0, w.damaged, w.s1, w.s2, w.s3
    nonlin = _nonlinearity(w)
    leak = 0.05 * mat.ae_gain * kappa * envelope
    ae = leak * (s1 + (nonlin * s2 if 2 * f0 < nyq_ok else 0) + (0.5 * nonlin * s3 if 3 * f0 < nyq_ok else 0))
    ae += 0.004 * w.noise[2]
    lo, hi = mat.ae_band
    hi = min(hi, nyq_ok)
    lo = min(lo, 0.6 * hi)
    slip = 2.2 * w_h + 1.4 * w_a + 1.6 * max(0.0, 1 - fric) - 0.5 * max(0.0, fric - 1)
    n_bursts = rng.poisson(mat.bursts * surf.burst_rate * max(0.3, 1 + slip))
    late = 1.0 + (1.2 if w.condition.surface == "contaminated" else 0.0) + 0.8 * (1 - min(kappa, 1.0))
    starts = rng.beta(1.2, 3.6 / late, size=n_bursts)
    amps = mat.ae_gain * 0.08 * rng.lognormal(0.0, 0.6, size=n_bursts) * (1 + 0.5 * w_h)
    freqs = surf.burst_freq * rng.uniform(lo, hi, size=n_bursts)
    _add_bursts(ae, starts, amps, freqs, rng.uniform(40e-6, 160e-6, size=n_bursts), fs, rng)
    if damaged:  # crack growth: sharp, high-frequency bursts spread over the weld
        k = rng.poisson(12 * damaged)
        _add_bursts(
            ae,
            rng.uniform(0.05, 0.95, size=k),
            mat.ae_gain * 0.25 * rng.lognormal(0, 0.4, size=k),
            rng.uniform(0.8 * hi, hi, size=k),
            rng.uniform(15e-6, 40e-6, size=k),
            fs,
            rng,
        )
    return ae


def _nonlinearity(w: _Weld) -> float:
    """Strength of the carrier's harmonics: the contact's nonlinearity, more with wear and cracks."""
    return w.mat.harmonic + 0.25 * w.w_h + 0.15 * w.w_a + 0.3 * w.damaged


def _microphone(w: _Weld, envelope: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Microphone: radiated carrier with harmonics (and a subharmonic when cracked)."""
    mat, f0, nyq_ok = w.mat, w.f0, w.nyq_ok
    h2 = 0.6 * _nonlinearity(w)
    mic = (
        mat.mic_gain
        * envelope
        * (w.s1 + (h2 * w.s2 if 2 * f0 < nyq_ok else 0) + (0.4 * h2 * w.s3 if 3 * f0 < nyq_ok else 0))
    )
    if w.condition.horn == "damaged":
        mic += mat.mic_gain * 0.25 * envelope * np.sin(0.5 * w.phase + rng.uniform(0, 2 * np.pi))
    return mic


def _knurl_chatter(
    w: _Weld, envelope: np.ndarray, f_ss: float, ae: np.ndarray, mic: np.ndarray, rng: np.random.Generator
) -> None:
    """Add knurl chatter at the contact resonance (module docstring) to ``ae`` and ``mic`` in place.

    Where it rings depends on the material pair and the surface, how loud on the tool's wear.
    """
    mat = w.mat
    chatter = w.w_h + 0.5 * w.w_a + 0.3 * w.damaged
    f_c = mat.contact_hz * w.surf.contact * rng.normal(1.0, 0.03)
    if chatter > 0 and f_c < w.nyq_ok:
        ring = envelope * np.sin(
            2 * np.pi * f_c * w.t + 0.3 * np.sin(2 * np.pi * f_ss * w.t) + rng.uniform(0, 2 * np.pi)
        )
        ae += mat.ae_gain * 0.03 * chatter * ring
        mic += mat.mic_gain * 0.15 * chatter * ring


def _add_bursts(
    x: np.ndarray,
    starts: np.ndarray,
    amps: np.ndarray,
    freqs: np.ndarray,
    decays: np.ndarray,
    fs: float,
    rng: np.random.Generator,
) -> None:
    """Add decaying tone bursts in place (start given as a fraction of the weld)."""
    n = len(x)
    for s, a, f, d in zip(starts, amps, freqs, decays, strict=True):
        i0 = int(s * n)
        m = min(int(5 * d * fs), n - i0)
        if m <= 1:
            continue
        k = np.arange(m) / fs
        x[i0 : i0 + m] += a * np.exp(-k / d) * np.sin(2 * np.pi * f * k + rng.uniform(0, 2 * np.pi))
