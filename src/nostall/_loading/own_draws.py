"""A sample's own random state, and the global draws of a loading thread routed to it.

Why: torch's global generator, Python's ``random`` and NumPy's ``np.random`` are each one stream
shared by every thread of the process. Samples loaded in parallel by ``threads=N`` that draw from
them (a random crop or flip, as torchvision's and most augmentation libraries' transforms draw)
would get whatever values the threads' timing hands them: other batches on every run. Worker
processes avoid it by seeding each worker; here each sample gets its own generators instead
(:class:`SampleRng`, seeded from the epoch's seed and the sample's place in the epoch), and
:func:`routed` sends the global entry points to them while a loading thread runs the sample.

What is routed, in the thread inside :func:`routed` only (every other thread, the training
loop's included, draws from the global generators as before):

* torch's random functions and in-place random methods called from Python without a
  ``generator=`` (:data:`_TAKE_GENERATOR`: ``torch.rand``, ``randn``, ``randint``, ``randperm``,
  ``normal``, ``bernoulli``, ``multinomial``, ``poisson``, the ``*_like`` ones,
  ``Tensor.uniform_``, ``normal_``, ``random_``, ``bernoulli_``, ``exponential_`` and the
  others, the ``torch.nn.init`` functions), for tensors made on the CPU: a
  :class:`~torch.overrides.TorchFunctionMode`, which torch keeps per thread, passes them the
  sample's ``torch.Generator``;
* Python's ``random`` module functions (``random.random``, ``randint``, ``choice``, ``shuffle``,
  ... and ``seed``, ``getstate``, ``setstate``): the sample's ``random.Random``;
* NumPy's legacy module functions (``np.random.rand``, ``randint``, ``uniform``, ``shuffle``,
  ... ``seed``, ``get_state``): the sample's ``np.random.RandomState``.

The module functions of ``random`` and ``np.random`` are replaced, process-wide and once, by
functions that pass through to the originals outside a routed thread (:func:`install`; NumPy's
once it is imported). What is left out draws from the global generators, and a trial sees it
(:mod:`nostall._sources.global_draws`: the samples are then loaded one at a time, in order, and
a warning names the generator, and for the dropouts of :data:`_NO_GENERATOR`, noted as they
are called, one such call and its line): torch functions that take no generator
(``F.dropout``, the ``torch.distributions`` samplers that call C++ samplers), a random op on
a CUDA tensor, a
function bound before :func:`install` ran (``from random import randint`` at import time), and
code that holds the generators themselves (``torch.default_generator``,
``np.random.mtrand._rand``). Generators of the user's own (``torch.Generator``, ``random.Random``,
``np.random.default_rng(seed)``) are left alone: they are already their own streams.
"""

from __future__ import annotations

import functools
import os
import random
import sys
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .._sources.generators import note_escape
from .._torch_compat import PRIVATE_SAMPLERS, default_device_is_cpu


class SampleRng:
    """One sample's random generators, as torch's thread-worker ``WorkerInfo.rng`` holds them.

    Invariant: every generator is seeded from ``seed`` alone, each made on first use (most
    samples draw from one or two of them, if any; a ``RandomState`` costs tens of us, the
    others a few, all of it holding the GIL while the other loading threads wait for it).
    """

    __slots__ = ("_legacy", "_numpy", "_random", "_torch", "seed")

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._torch: torch.Generator | None = None
        self._random: random.Random | None = None
        self._numpy: Any = None
        self._legacy: Any = None

    @property
    def torch_generator(self) -> torch.Generator:
        """A CPU ``torch.Generator`` seeded with ``seed``."""
        if self._torch is None:
            self._torch = torch.Generator().manual_seed(self.seed)
        return self._torch

    @property
    def random_generator(self) -> random.Random:
        """A ``random.Random`` seeded with ``seed``."""
        if self._random is None:
            self._random = random.Random(self.seed)
        return self._random

    @property
    def numpy_generator(self) -> Any:
        """A NumPy ``Generator`` seeded alike, made on first use (None without NumPy)."""
        if self._numpy is None:
            try:
                import numpy as np
            except ImportError:
                return None
            self._numpy = np.random.default_rng(self.seed)
        return self._numpy

    @property
    def legacy_numpy(self) -> Any:
        """A NumPy ``RandomState`` seeded alike (what ``np.random.rand`` and its kin draw from)."""
        if self._legacy is None:
            import numpy as np

            self._legacy = np.random.RandomState(np.random.MT19937(self.seed))
        return self._legacy


class _Here(threading.local):
    #: The routed thread's sample generators; None outside :func:`routed`.
    rng: SampleRng | None = None


_here = _Here()


def routed(rng: SampleRng) -> AbstractContextManager[None]:
    """Meanwhile, in this thread only, the global random entry points draw from ``rng``.

    Nested, the inner ``rng`` applies until it ends. :func:`install` must have run (the
    module functions of ``random`` and ``np.random``); NumPy imported since is installed here.
    """
    return _Routed(rng)


class _Routed:
    """:func:`routed`'s context: a class, as entered once a sample (a generator's costs more)."""

    __slots__ = ("before", "mode", "rng")

    def __init__(self, rng: SampleRng) -> None:
        self.rng = rng
        self.before: SampleRng | None = None
        self.mode = _OwnTorch()

    def __enter__(self) -> None:
        if _numpy_pending():
            install()
        self.before, _here.rng = _here.rng, self.rng
        try:
            self.mode.__enter__()  # type: ignore[no-untyped-call]
        except BaseException:
            _here.rng = self.before
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            self.mode.__exit__(*exc)  # type: ignore[no-untyped-call]
        finally:
            _here.rng = self.before


def current() -> SampleRng | None:
    """The generators this thread's global draws go to now (None: the global ones)."""
    return _here.rng


def _torch_random() -> frozenset[Any]:
    t = torch.Tensor
    init = torch.nn.init
    return frozenset(
        (
            torch.rand,
            torch.randn,
            torch.randint,
            torch.randperm,
            torch.normal,
            torch.bernoulli,
            torch.multinomial,
            torch.poisson,
            torch.binomial,
            *PRIVATE_SAMPLERS,  # torch.distributions' Gamma, Beta, Dirichlet
            torch.rand_like,
            torch.randn_like,
            torch.randint_like,
            t.uniform_,
            t.normal_,
            t.random_,
            t.bernoulli_,
            t.bernoulli,
            t.exponential_,
            t.geometric_,
            t.log_normal_,
            t.cauchy_,
            t.multinomial,
            init.uniform_,
            init.normal_,
            init.trunc_normal_,
            init.kaiming_uniform_,
            init.kaiming_normal_,
            init.xavier_uniform_,
            init.xavier_normal_,
            init.orthogonal_,
            init.sparse_,
        )
    )


#: torch's random entry points that take ``generator=`` (each checked by the tests).
_TAKE_GENERATOR = _torch_random()


def _self_on_cpu(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> bool:
    """For a ``Tensor`` method's call (its tensor is ``args[0]``): it draws for the CPU.

    These methods take ``generator=`` by keyword only: none can be given by position.
    """
    return bool(args) and getattr(args[0], "is_cpu", False) is True


def _made_on_cpu(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> bool:
    """For ``torch.rand``, ``randn``, ``randint``, ``randperm``: the tensor made is a CPU one.

    Their positional arguments are sizes and bounds, and ``generator=`` is keyword only: the
    tensor's device is its ``out=``'s, else its ``device=``, else torch's default device.
    """
    if kwargs:
        out = kwargs.get("out")
        if out is not None:
            return getattr(out, "is_cpu", False) is True
        device = kwargs.get("device")
        if device is not None:
            return torch.device(device).type == "cpu"
    return default_device_is_cpu()


def _routes() -> dict[Any, Callable[[tuple[Any, ...], dict[str, Any] | None], bool]]:
    """Each of :data:`_TAKE_GENERATOR`, and how to tell that a call of it draws for the CPU.

    The ops samples call most (a flip's ``torch.rand``, a crop's ``uniform_`` and
    ``randint``) get a check made for their signature; the others the general one.
    """
    t = torch.Tensor
    methods: tuple[Any, ...] = (t.uniform_, t.normal_, t.random_, t.bernoulli_, t.bernoulli)
    methods += (t.exponential_, t.geometric_, t.log_normal_, t.cauchy_, t.multinomial)
    factories = (torch.rand, torch.randn, torch.randint, torch.randperm)
    routes: dict[Any, Callable[[tuple[Any, ...], dict[str, Any] | None], bool]] = {}
    for func in _TAKE_GENERATOR:
        routes[func] = _routable
    routes.update(dict.fromkeys(methods, _self_on_cpu))
    routes.update(dict.fromkeys(factories, _made_on_cpu))
    for func in _NO_GENERATOR:
        routes[func] = _noting(f"F.{func.__name__}")
    return routes


#: torch's functions that draw from the global generator and take no ``generator=``: never
#: routed, but each call in a sample is noted with its caller's line, which the warning about
#: draws that escape names (:func:`nostall._sources.generators.note_escape`).
_NO_GENERATOR: tuple[Any, ...] = (
    F.dropout,
    F.dropout1d,
    F.dropout2d,
    F.dropout3d,
    F.alpha_dropout,
    F.feature_alpha_dropout,
    F.rrelu,
)

#: Where torch's and nostall's own code lives: the caller named is the first frame outside.
#: (With the separator: torchvision's or torchdata's folder is not torch's.)
_LIBRARIES = tuple(
    os.path.join(os.path.dirname(path), "") for path in (torch.__file__, os.path.dirname(__file__))
)


def _noting(name: str) -> Callable[[tuple[Any, ...], dict[str, Any] | None], bool]:
    """A check that routes nothing and notes ``name``'s call with its caller's file and line."""

    def noted(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> bool:
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(_LIBRARIES):
            frame = frame.f_back  # type: ignore[assignment]
        where = "" if frame is None else f" at {frame.f_code.co_filename}:{frame.f_lineno}"
        note_escape(f"{name}{where}")
        return False

    return noted


class _OwnTorch(TorchFunctionMode):
    """Passes this thread's sample generator to torch's random calls that were given none."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        # Kept short: it runs for every torch call a sample makes, holding the GIL.
        on_cpu = _ROUTES.get(func)
        if on_cpu is not None and (rng := _here.rng) is not None:
            if not kwargs:
                if on_cpu(args, None):
                    return func(*args, generator=rng.torch_generator)
            elif kwargs.get("generator") is None and on_cpu(args, kwargs):
                return func(*args, **{**kwargs, "generator": rng.torch_generator})
        return func(*args, **kwargs) if kwargs else func(*args)


def _routable(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> bool:
    """Whether the sample's generator may be given to this call of a random op.

    Not where a generator was given by position; only where the op draws for CPU tensors
    (the sample's generator is a CPU one). Its tensor may come by position or by keyword
    (``nn.init`` passes ``tensor=``); a factory's device is its ``device=``, else torch's
    default device. The general check, for any op of :data:`_TAKE_GENERATOR`.
    """
    kwargs = kwargs or {}
    tensor = None
    for value in (*args, *kwargs.values()) if kwargs else args:
        if type(value) in _PLAIN:
            continue  # the usual sizes and bounds: no isinstance (torch's types ask Python)
        if isinstance(value, torch.Generator):
            return False  # torch.poisson(rates, g): the caller's generator, by position
        if tensor is None and isinstance(value, torch.Tensor):
            tensor = value
    if tensor is not None:
        return bool(tensor.is_cpu)
    device = kwargs.get("device")
    if device is None:
        return default_device_is_cpu()
    return torch.device(device).type == "cpu"


#: Types of arguments that are neither a generator nor a tensor, passed over at once.
_PLAIN = frozenset((int, float, bool, tuple, list, str, type(None), torch.Size, torch.dtype))

#: How :class:`_OwnTorch` tells, for each op of :data:`_TAKE_GENERATOR`, that a call draws for
#: the CPU (see :func:`_routes`).
_ROUTES = _routes()


#: Whether :func:`install` replaced ``random``'s functions, and NumPy's (once imported).
_installed = {"random": False, "numpy": False}
_install_lock = threading.Lock()


def install() -> None:
    """Replace ``random``'s and ``np.random``'s module functions by routing ones (once).

    Each replacement calls the original outside :func:`routed`, so the process sees no change
    but a Python call more per draw. NumPy is done once it is imported (``routed`` checks).
    """
    with _install_lock:
        if not _installed["random"]:
            _replace(random, random._inst, lambda rng: rng.random_generator)
            _installed["random"] = True
        numpy: Any = sys.modules.get("numpy")
        # numpy.random is imported here if NumPy is (once, tens of ms): left to be imported
        # lazily inside a sample, that sample's first draws would reach the originals.
        mtrand = getattr(getattr(numpy, "random", None), "mtrand", None)
        if not _installed["numpy"] and getattr(mtrand, "_rand", None) is not None:
            _replace(numpy.random, numpy.random.mtrand._rand, _legacy)
            # Module functions of NumPy's that draw from the same state without being its
            # bound methods: routed to the sample's methods of the same meaning.
            for name, method in (("seed", "seed"), ("sample", "random_sample")):
                original = getattr(numpy.random, name, None)
                if original is not None:
                    routing = _routing(numpy.random, name, method, original, _legacy)
                    setattr(numpy.random, name, routing)
            if hasattr(numpy.random, "ranf"):
                numpy.random.ranf = numpy.random.sample
            _installed["numpy"] = True


def _legacy(rng: SampleRng) -> Any:
    return rng.legacy_numpy


def _numpy_pending() -> bool:
    # Once its random module is loaded: "numpy" is in sys.modules while it is still importing.
    return not _installed["numpy"] and "numpy.random.mtrand" in sys.modules


def _replace(module: Any, instance: Any, own: Callable[[SampleRng], Any]) -> None:
    """Each of ``module``'s functions bound to ``instance`` routes to ``own(rng)`` when routed."""
    for name in dir(module):
        original = getattr(module, name)
        if getattr(original, "__self__", None) is not instance or name.startswith("_"):
            continue
        setattr(module, name, _routing(module, name, name, original, own))


def _routing(
    module: Any,
    attribute: str,
    method: str,
    original: Callable[..., Any],
    own: Callable[[SampleRng], Any],
) -> Any:
    """``module.attribute``'s replacement: ``original``, or ``own(rng).method`` when routed."""

    @functools.wraps(original)
    def draw(*args: Any, **kwargs: Any) -> Any:
        rng = _here.rng
        if rng is None:
            return original(*args, **kwargs)
        return getattr(own(rng), method)(*args, **kwargs)

    draw.__nostall_routes__ = original  # type: ignore[attr-defined]
    # Pickled by reference, as the original is (a dataset holding random.random, a partial
    # of np.random.uniform): found again under the module's own name.
    draw.__module__, draw.__qualname__ = module.__name__, attribute
    return draw
