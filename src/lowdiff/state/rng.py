"""The RNG states a checkpoint holds: torch's CPU generator, CUDA's (when initialised),
Python's ``random`` and NumPy's legacy global generator (``np.random.*``).

:func:`capture_rng` reads them through their public APIs (a full checkpoint, a
baseline). :class:`RngCapture` writes them into a record row at every step, where
``random.getstate()`` and ``np.random.get_state()`` are the costliest part of a record's
bookkeeping (they build a 625-element tuple and a 624-word array each time: about 30 and
75 µs inside a training step on a small CPU machine). Both Mersenne Twisters keep their
state words in place inside the object that owns them, so on CPython the capture copies
that memory instead (:class:`_PythonWords`, :class:`_NumpyWords`): one copy each, a few
µs. Where those words are is not assumed: each is located by matching what the public API returns, and checked against
it through draws that change every part of the state (the words, the position, the
cached Gaussian) before it is used; if anything differs (another interpreter, another
NumPy) the capture keeps the public API. Either way the row holds exactly what the
public API would return (``tests/engine/test_hot_path.py`` compares the two). Each read
is one copy that keeps the GIL (NumPy's under its generator's lock, which its draws hold
without the GIL), so a draw on another thread falls before or after it, never inside.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import random
import struct
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

_MT_WORDS = 624
"""Words of a Mersenne Twister's state (MT19937): Python's and NumPy's alike."""


class RngLayout:
    """Which RNG states this process has, and how big each is (fixed for a session)."""

    def __init__(self) -> None:
        # Only the current device: touching every device would create a CUDA context on
        # each of them in every rank of a multi-GPU job.
        self.cuda = bool(torch.cuda.is_available())
        self.numpy = "numpy" in sys.modules

    def specs(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        specs: list[tuple[str, torch.dtype, tuple[int, ...]]] = [
            ("rng.torch", torch.uint8, tuple(torch.get_rng_state().shape)),
            ("rng.python", torch.uint32, (_MT_WORDS + 1,)),
        ]
        if self.cuda:
            specs.append(("rng.cuda", torch.uint8, tuple(torch.cuda.get_rng_state().shape)))
        if self.numpy:
            specs.append(("rng.numpy", torch.uint32, (_MT_WORDS,)))
        return specs

    def to_dict(self) -> dict[str, Any]:
        return {"cuda": self.cuda, "numpy": self.numpy}


def capture_rng(layout: RngLayout) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """RNG states as fixed-size tensors plus a few small JSON-able values."""
    tensors: dict[str, torch.Tensor] = {"rng.torch": torch.get_rng_state()}
    version, internal, gauss = random.getstate()
    tensors["rng.python"] = torch.tensor(internal, dtype=torch.int64).to(torch.uint32)
    extra: dict[str, Any] = {"python": [version, gauss]}
    if layout.cuda:
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    if layout.numpy:
        name, keys, pos, has_gauss, cached = np.random.get_state()  # type: ignore[misc]
        tensors["rng.numpy"] = torch.from_numpy(np.asarray(keys, dtype=np.uint32))
        extra["numpy"] = [name, int(pos), int(has_gauss), float(cached)]
    return tensors, extra


def restore_rng(tensors: Mapping[str, torch.Tensor], extra: Mapping[str, Any]) -> None:
    """Set every RNG to the state :func:`capture_rng` (or :class:`RngCapture`) took."""
    torch.set_rng_state(tensors["rng.torch"].clone())
    version, gauss = extra["python"]
    random.setstate(
        (int(version), tuple(int(x) for x in tensors["rng.python"].to(torch.int64).tolist()), gauss)
    )
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"].cpu().clone())
    if "rng.numpy" in tensors and "numpy" in extra:
        name, pos, has_gauss, cached = extra["numpy"]
        np.random.set_state(
            (
                name,
                tensors["rng.numpy"].to(torch.int64).numpy().astype(np.uint32),
                pos,
                has_gauss,
                cached,
            )
        )


# --------------------------------------------------------------------------- in place


def _bound_to(method: Any) -> Any:
    """The generator a module-level function (``random.getstate``) draws from."""
    return method.__self__


def _snapshot(address: int, n: int) -> np.ndarray:
    """A copy of the ``n`` int32 words at ``address`` (a read-only array), taken in one
    call that keeps the GIL (``ctypes.string_at``), so that no draw of another Python
    thread falls inside it (a tensor copy would let one in)."""
    return np.frombuffer(ctypes.string_at(address, 4 * n), dtype=np.int32)


def _find(raw: bytes, needle: bytes, align: int) -> int:
    """The one offset of ``needle`` in ``raw`` aligned to ``align``, or -1 (none or several)."""
    found, at = [], raw.find(needle)
    while at >= 0:
        if at % align == 0:
            found.append(at)
        at = raw.find(needle, at + 1)
    return found[0] if len(found) == 1 else -1


def _located(obj: Any, words: bytes, what: str) -> int:
    """The address of ``words`` (a generator's state, 4-byte aligned) inside ``obj``."""
    at = _find(ctypes.string_at(id(obj), type(obj).__basicsize__), words, 4)
    if at < 4:
        raise LookupError(f"the state words of {what} were not found in place")
    return id(obj) + at


class _PythonWords:
    """CPython's ``random`` generator read in place: its 624 state words and position
    (``random.getstate()[1]``, position last) from the C struct, the cached Gaussian from
    the instance's ``gauss_next``.

    Raises:
        LookupError: where the words cannot be located or do not follow the public API.
    """

    def __init__(self) -> None:
        rng = _bound_to(random.getstate)  # the instance the module functions draw from
        self.rng = rng
        saved = rng.getstate()
        self.version = saved[0]
        try:
            words = struct.pack(f"={_MT_WORDS}I", *saved[1][:_MT_WORDS])
            address = _located(rng, words, "random")
            self._address = address - 4  # the position, then the words
            # the words turn over and the position moves; a Gaussian is cached (read from
            # the attribute getstate() itself reads)
            self._check(lambda: (rng.getrandbits(32 * (_MT_WORDS + 1)), rng.gauss()))
        finally:
            rng.setstate(saved)
        self._check(lambda: None)

    def _check(self, draw: Any) -> None:
        draw()
        v = torch.empty(_MT_WORDS + 1, dtype=torch.int32)
        gauss = self.into(v)
        if v.tolist() != [x - (1 << 32) if x >= 1 << 31 else x for x in self.rng.getstate()[1]]:
            raise LookupError("random's state read in place differs from random.getstate()")
        if gauss != self.rng.getstate()[2]:
            raise LookupError("random's cached Gaussian differs from random.getstate()")

    def current(self) -> bool:
        """Whether ``random``'s module functions still draw from the generator located."""
        return _bound_to(random.getstate) is self.rng

    def into(self, dst: torch.Tensor) -> Any:
        """Write ``getstate()[1]`` into ``dst`` (625 int32); returns ``getstate()[2]``."""
        now, out = _snapshot(self._address, _MT_WORDS + 1), dst.numpy()
        out[:_MT_WORDS] = now[1:]
        out[_MT_WORDS] = now[0]
        return self.rng.gauss_next


class _NumpyWords:
    """NumPy's legacy global generator (``np.random.*``) read in place: the key and
    position from its MT19937's state struct, the cached Gaussian (``has_gauss``,
    ``gauss``) from the ``RandomState`` object.

    Raises:
        LookupError: where these cannot be located or do not follow ``np.random.get_state()``.
    """

    _PROBES = (0.3183098861837907, -2.718281828459045e-123)
    """Cached Gaussians set while locating the cache: values no draw leaves there."""

    def __init__(self) -> None:
        rs = _bound_to(np.random.get_state)
        self.rs = rs
        self.bitgen = rs._bit_generator
        if type(self.bitgen).__name__ != "MT19937":
            raise LookupError(f"np.random draws from {type(self.bitgen).__name__}, not MT19937")
        saved = rs.get_state()
        name, keys = saved[0], saved[1]
        try:
            # the key sits in the bit generator's own memory (its C struct, key then position)
            address = _located(
                self.bitgen, np.asarray(keys, dtype=np.uint32).tobytes(), "np.random"
            )
            self._address = address  # the key, then the position
            size = type(rs).__basicsize__
            at = []
            for probe in self._PROBES:
                rs.set_state((name, keys, 7, 1, probe))
                raw = ctypes.string_at(id(rs), size)
                at.append(_find(raw, struct.pack("=d", probe), 8))
            if at[0] < 8 or at[0] != at[1]:
                raise LookupError("np.random's cached Gaussian was not found in place")
            self._gauss = ctypes.c_double.from_address(id(rs) + at[0])
            self._has_gauss = ctypes.c_int.from_address(id(rs) + at[0] - 8)
            self._check(lambda: None)  # a position set, a Gaussian cached by hand
            # the key turns over and the position moves, a Gaussian is cached; then taken
            self._check(lambda: (rs.randint(0, 2**31, size=_MT_WORDS + 1), rs.standard_normal()))
            self._check(rs.standard_normal)
        finally:
            rs.set_state(saved)
        self._check(lambda: None)

    def _check(self, draw: Any) -> None:
        draw()
        v = torch.empty(_MT_WORDS, dtype=torch.int32)
        extra = self.into(v)
        name, keys, pos, has_gauss, cached = self.rs.get_state()
        if not np.array_equal(v.numpy().view(np.uint32), np.asarray(keys, dtype=np.uint32)):
            raise LookupError("np.random's key read in place differs from np.random.get_state()")
        if extra != [name, int(pos), int(has_gauss), float(cached)]:
            raise LookupError(
                f"np.random's state read in place ({extra}) differs from np.random.get_state()"
            )

    def usable(self) -> bool:
        """Whether ``np.random`` still draws from the generator located (NumPy's
        ``set_bit_generator`` can replace it)."""
        return self.rs._bit_generator is self.bitgen

    def current(self) -> bool:
        return _bound_to(np.random.get_state) is self.rs and self.usable()

    def into(self, dst: torch.Tensor) -> list[Any]:
        """Write the key into ``dst`` (624 int32); returns ``[name, pos, has_gauss, gauss]``."""
        with self.bitgen.lock:  # NumPy draws hold it, without the GIL, while they change the state
            now = _snapshot(self._address, _MT_WORDS + 1)
            cached = [self._has_gauss.value, self._gauss.value]
        dst.numpy()[:] = now[:_MT_WORDS]
        return ["MT19937", int(now[_MT_WORDS]), *cached]


_LOCATED: dict[type[Any], Any] = {}
"""Per kind, what was located in this process (None: it could not be): located once, as
long as it still reads the generator the module functions draw from."""


def _in_place(kind: type[_PythonWords] | type[_NumpyWords]) -> Any:
    """``kind()``, or None where its state cannot be read in place."""
    if kind in _LOCATED:
        found = _LOCATED[kind]
        if found is None or found.current():
            return found
    found = None
    with contextlib.suppress(Exception):
        found = kind()
    _LOCATED[kind] = found
    return found


class RngCapture:
    """Writes the RNG states of :class:`RngLayout` into a record row each step: what
    :func:`capture_rng` returns, read in place where it can be (see the module docstring).

    Args:
        layout: the RNGs a row holds.
        in_place: read Python's and NumPy's states in place where they can be located
            (False: always through ``getstate()`` / ``get_state()``).
    """

    def __init__(self, layout: RngLayout, in_place: bool = True) -> None:
        self.layout = layout
        self.python: _PythonWords | None = _in_place(_PythonWords) if in_place else None
        self.numpy: _NumpyWords | None = None
        if layout.numpy and in_place:
            self.numpy = _in_place(_NumpyWords)
        self._py_state: tuple[int, ...] | None = None
        self._py_tensor: torch.Tensor | None = None

    def into(self, views: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Copy the states into ``views`` (a row's ``rng.*`` tensors); the JSON-able rest."""
        views["rng.torch"].copy_(torch.get_rng_state())
        py = views["rng.python"].view(torch.int32)
        if self.python is not None:
            extra: dict[str, Any] = {"python": [self.python.version, self.python.into(py)]}
        else:
            extra = {"python": self._python_slow(py)}
        if self.layout.cuda:
            views["rng.cuda"].copy_(torch.cuda.get_rng_state())
        if self.layout.numpy:
            dst = views["rng.numpy"].view(torch.int32)
            if self.numpy is not None and self.numpy.usable():
                extra["numpy"] = self.numpy.into(dst)
            else:
                extra["numpy"] = self._numpy_slow(dst)
        return extra

    def _python_slow(self, dst: torch.Tensor) -> list[Any]:
        # the state as a tensor only when it changed since the previous step
        version, internal, gauss = random.getstate()
        if internal != self._py_state or self._py_tensor is None:
            words = array.array("I", internal) if array.array("I").itemsize == 4 else None
            if words is not None:
                self._py_tensor = torch.frombuffer(words, dtype=torch.int32).clone()
            else:
                self._py_tensor = torch.tensor(internal, dtype=torch.int64).to(torch.int32)
            self._py_state = internal
        dst.copy_(self._py_tensor)
        return [version, gauss]

    @staticmethod
    def _numpy_slow(dst: torch.Tensor) -> list[Any]:
        name, keys, pos, has_gauss, cached = np.random.get_state()  # type: ignore[misc]
        dst.copy_(torch.from_numpy(np.asarray(keys, dtype=np.uint32).view(np.int32)))
        return [name, int(pos), int(has_gauss), float(cached)]


__all__ = ["RngCapture", "RngLayout", "capture_rng", "restore_rng"]
