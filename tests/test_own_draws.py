"""A loading thread's global draws go to the sample's own generators, in that thread only."""

from __future__ import annotations

import contextlib
import random
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from nostall._loading import own_draws
from nostall._loading.own_draws import SampleRng, current, install, routed
from nostall._sources.generators import (
    NUMPY,
    PYTHON,
    TORCH,
    escape_since,
    escapes_noted,
    moved,
    snapshot,
)
from nostall._torch_compat import PRIVATE_SAMPLERS

#: Each routed torch entry point, called as a transform calls it, with ``generator=`` where
#: the test asks for it (None: the global one).
TORCH_DRAWS: dict[str, Callable[[Any], Any]] = {
    "rand": lambda g: torch.rand(3, generator=g),
    "randn": lambda g: torch.randn(3, generator=g),
    "randint": lambda g: torch.randint(0, 100, (3,), generator=g),
    "randint size=": lambda g: torch.randint(0, 100, size=(3,), generator=g),  # as torchvision
    "rand dtype=": lambda g: torch.rand(3, dtype=torch.float64, generator=g),
    "randperm": lambda g: torch.randperm(5, generator=g),
    "normal": lambda g: torch.normal(torch.zeros(3), torch.ones(3), generator=g),
    "bernoulli": lambda g: torch.bernoulli(torch.full((3,), 0.5), generator=g),
    "multinomial": lambda g: torch.multinomial(torch.ones(4), 2, generator=g),
    "poisson": lambda g: torch.poisson(torch.ones(3), generator=g),
    "rand_like": lambda g: torch.rand_like(torch.zeros(3), generator=g),
    "uniform_": lambda g: torch.empty(3).uniform_(0.35, 1.0, generator=g),
    "normal_": lambda g: torch.empty(3).normal_(generator=g),
    "random_": lambda g: torch.empty(3).random_(0, 9, generator=g),
    "exponential_": lambda g: torch.empty(3).exponential_(generator=g),
    "bernoulli_": lambda g: torch.empty(3).bernoulli_(0.5, generator=g),
    "init.uniform_": lambda g: torch.nn.init.uniform_(torch.empty(3), generator=g),
    "beta": lambda g: torch.distributions.Beta(torch.ones(3), torch.ones(3)).sample(),
}


@pytest.mark.parametrize("name", sorted(TORCH_DRAWS))
def test_torchs_random_calls_draw_from_the_samples_generator(name: str) -> None:
    """The same values as with the sample's generator passed; the global one does not move."""
    draw = TORCH_DRAWS[name]
    before = snapshot()
    with routed(SampleRng(11)):
        values = draw(None)
    assert () == moved(before, snapshot())
    if name != "beta":  # takes no generator=: compared with another routed sample's
        torch.testing.assert_close(values, draw(SampleRng(11).torch_generator), rtol=0, atol=0)
    with routed(SampleRng(11)):
        torch.testing.assert_close(values, draw(None), rtol=0, atol=0)


def test_each_routed_torch_function_takes_a_generator() -> None:
    """Every routed function, called with ``generator=``: a torch that dropped it fails here."""
    t, init, g = torch.Tensor, torch.nn.init, torch.Generator()
    p = torch.full((3,), 0.5)
    calls: dict[Any, Callable[[], Any]] = {
        torch.rand: lambda: torch.rand(2, generator=g),
        torch.randn: lambda: torch.randn(2, generator=g),
        torch.randint: lambda: torch.randint(0, 5, (2,), generator=g),
        torch.randperm: lambda: torch.randperm(4, generator=g),
        torch.normal: lambda: torch.normal(p, p, generator=g),
        torch.bernoulli: lambda: torch.bernoulli(p, generator=g),
        torch.multinomial: lambda: torch.multinomial(p, 2, generator=g),
        torch.poisson: lambda: torch.poisson(p, generator=g),
        torch.binomial: lambda: torch.binomial(p, p, generator=g),
        PRIVATE_SAMPLERS[0]: lambda: PRIVATE_SAMPLERS[0](p, generator=g),
        PRIVATE_SAMPLERS[1]: lambda: PRIVATE_SAMPLERS[1](p, generator=g),
        torch.rand_like: lambda: torch.rand_like(p, generator=g),
        torch.randn_like: lambda: torch.randn_like(p, generator=g),
        torch.randint_like: lambda: torch.randint_like(p, 5, generator=g),
        t.uniform_: lambda: p.clone().uniform_(generator=g),
        t.normal_: lambda: p.clone().normal_(generator=g),
        t.random_: lambda: p.clone().random_(generator=g),
        t.bernoulli_: lambda: p.clone().bernoulli_(0.5, generator=g),
        t.bernoulli: lambda: p.bernoulli(generator=g),
        t.exponential_: lambda: p.clone().exponential_(generator=g),
        t.geometric_: lambda: p.clone().geometric_(0.5, generator=g),
        t.log_normal_: lambda: p.clone().log_normal_(generator=g),
        t.cauchy_: lambda: p.clone().cauchy_(generator=g),
        t.multinomial: lambda: p.multinomial(2, generator=g),
        init.uniform_: lambda: init.uniform_(p.clone(), generator=g),
        init.normal_: lambda: init.normal_(p.clone(), generator=g),
        init.trunc_normal_: lambda: init.trunc_normal_(p.clone(), generator=g),
        init.kaiming_uniform_: lambda: init.kaiming_uniform_(torch.empty(2, 2), generator=g),
        init.kaiming_normal_: lambda: init.kaiming_normal_(torch.empty(2, 2), generator=g),
        init.xavier_uniform_: lambda: init.xavier_uniform_(torch.empty(2, 2), generator=g),
        init.xavier_normal_: lambda: init.xavier_normal_(torch.empty(2, 2), generator=g),
        init.orthogonal_: lambda: init.orthogonal_(torch.empty(2, 2), generator=g),
        init.sparse_: lambda: init.sparse_(torch.empty(2, 2), 0.5, generator=g),
    }
    assert own_draws._TAKE_GENERATOR == set(calls)
    for func, call in calls.items():
        state = g.get_state()
        call()
        assert not torch.equal(state, g.get_state()), func


def test_pythons_and_numpys_module_functions_draw_from_the_samples_own() -> None:
    install()
    before = snapshot()
    with routed(SampleRng(5)):
        drawn = (random.random(), random.randint(0, 10**9), np.random.rand(), np.random.randint(9))
        shuffled = list(range(10))
        random.shuffle(shuffled)
        sampled = np.random.sample()
    assert () == moved(before, snapshot())
    rng = SampleRng(5)
    own = rng.random_generator
    legacy = rng.legacy_numpy
    assert drawn == (own.random(), own.randint(0, 10**9), legacy.rand(), legacy.randint(9))
    expected = list(range(10))
    own.shuffle(expected)
    assert expected == shuffled
    assert legacy.random_sample() == sampled


def test_outside_a_routed_thread_the_global_generators_draw_as_before() -> None:
    install()
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    before = snapshot()
    values = (random.random(), np.random.rand(), torch.rand(1).item())
    assert {TORCH, PYTHON, NUMPY} == set(moved(before, snapshot()))
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    assert values == (random.random(), np.random.rand(), torch.rand(1).item())
    assert random.random.__nostall_routes__ is not None  # type: ignore[attr-defined]


def test_routing_holds_in_its_thread_only() -> None:
    """While a loading thread is routed, another thread draws from the global generators."""
    install()
    inside, done = threading.Event(), threading.Event()
    seen: list[Any] = []

    def loading() -> None:
        with routed(SampleRng(1)):
            inside.set()
            done.wait(30)
            seen.append((torch.rand(1).item(), random.random(), current()))

    thread = threading.Thread(target=loading)
    thread.start()
    assert inside.wait(30)
    before = snapshot()
    torch.rand(1)
    random.random()
    assert {TORCH, PYTHON} == set(moved(before, snapshot()))
    assert current() is None
    done.set()
    thread.join(30)
    rng = SampleRng(1)
    own = (torch.rand(1, generator=rng.torch_generator).item(), rng.random_generator.random())
    assert [own] == [values[:2] for values in seen]
    assert seen[0][2] is not None


def test_nested_routing_ends_where_it_began() -> None:
    outer, inner = SampleRng(1), SampleRng(2)
    with routed(outer):
        with routed(inner):
            assert inner is current()
        assert outer is current()
    assert current() is None


def test_what_is_left_out_draws_from_the_global_generator() -> None:
    """F.dropout takes no generator=, and a generator passed is the caller's: not routed."""
    draws: list[Callable[[], torch.Tensor]] = [
        lambda: torch.nn.functional.dropout(torch.ones(8), 0.5),
        lambda: torch.rand(2, generator=torch.default_generator),
    ]
    for draw in draws:
        before = snapshot()
        with routed(SampleRng(1)):
            draw()
        assert (TORCH,) == moved(before, snapshot())


def test_a_random_op_for_another_device_or_with_its_own_generator_is_left_alone() -> None:
    """The sample's generator is a CPU one; a generator given by position is the caller's."""
    assert own_draws._routable((), {})
    assert own_draws._routable((torch.zeros(1),), {})
    assert own_draws._routable((), {"tensor": torch.zeros(1)})
    assert not own_draws._routable((), {"device": "meta"})
    assert not own_draws._routable((torch.zeros(1, device="meta"),), {})
    assert not own_draws._routable((), {"tensor": torch.zeros(1, device="meta")})  # nn.init
    assert not own_draws._routable((torch.ones(2), torch.Generator()), {})
    with routed(SampleRng(1)):
        assert "meta" == torch.rand(2, device="meta").device.type
        assert "meta" == torch.randint(9, (2,), out=torch.empty(2, device="meta")).device.type
        assert "meta" == torch.empty(2, device="meta").uniform_().device.type
        with torch.device("meta"):
            assert "meta" == torch.randn(2).device.type
        torch.nn.init.uniform_(torch.empty(2, device="meta"))  # tensor= by keyword: left alone
        g = torch.Generator().manual_seed(4)
        drawn = torch.poisson(torch.ones(3), g)  # by position: the caller's
    torch.testing.assert_close(
        drawn, torch.poisson(torch.ones(3), torch.Generator().manual_seed(4))
    )


class _Passed(torch.overrides.TorchFunctionMode):
    """Records the ``generator=`` each torch call below the routing is given."""

    def __init__(self) -> None:
        super().__init__()
        self.generators: list[object] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.generators.append((kwargs or {}).get("generator"))
        return func(*args, **(kwargs or {}))


#: Random calls as samples make them, and whether each draws for the CPU (gets the sample's
#: generator); the others are for a tensor of another device (left alone).
ROUTED_OR_NOT: dict[str, tuple[Callable[[], Any], bool]] = {
    "method, CPU tensor": (lambda: torch.empty(2).uniform_(), True),
    "method, meta tensor": (lambda: torch.empty(2, device="meta").uniform_(), False),
    "factory": (lambda: torch.rand(2), True),
    "factory, size=": (lambda: torch.randint(9, size=(2,)), True),
    "factory, device=meta": (lambda: torch.rand(2, device="meta"), False),
    "factory, out= CPU": (lambda: torch.randint(9, (2,), out=torch.empty(2)), True),
    "factory, out= meta": (
        lambda: torch.randint(9, (2,), out=torch.empty(2, device="meta")),
        False,
    ),
    "like, meta tensor": (lambda: torch.rand_like(torch.empty(2, device="meta")), False),
    "like, CPU tensor": (lambda: torch.rand_like(torch.empty(2)), True),
}


@pytest.mark.parametrize("case", sorted(ROUTED_OR_NOT))
def test_the_samples_generator_goes_to_calls_that_draw_for_the_cpu_only(case: str) -> None:
    """Seen from below the routing: its generator goes exactly where the call draws on the CPU."""
    call, on_cpu = ROUTED_OR_NOT[case]
    rng = SampleRng(3)
    with _Passed() as passed, routed(rng):
        call()
    given = [g for g in passed.generators if g is not None]
    assert ([rng.torch_generator] if on_cpu else []) == given


@pytest.mark.parametrize("where", ["a device mode", "a default device"])
def test_a_factory_made_on_another_default_device_is_left_alone(where: str) -> None:
    """``torch.rand(2)`` under a meta default set outside the routing: no generator given."""
    rng = SampleRng(3)
    around = torch.device("meta") if where == "a device mode" else contextlib.nullcontext()
    if where == "a default device":
        torch.set_default_device("meta")
    try:
        with around, _Passed() as passed, routed(rng):
            made = torch.rand(2)
    finally:
        torch.set_default_device(None)
    assert "meta" == made.device.type
    assert [] == [g for g in passed.generators if g is not None]


def test_every_routed_torch_function_has_its_check_of_the_device() -> None:
    """The quick checks cover exactly the routed functions; a missing one is never routed."""
    routed_ones = {f for f in own_draws._ROUTES if f not in own_draws._NO_GENERATOR}
    assert own_draws._TAKE_GENERATOR == routed_ones


@pytest.mark.parametrize("call", ["dropout", "dropout2d", "alpha_dropout", "rrelu"])
def test_a_draw_without_generator_is_noted_with_the_callers_line(call: str) -> None:
    """Not routed (the global generator moves), but noted: what was called, and where."""
    before, count = snapshot(), escapes_noted()
    with routed(SampleRng(1)):
        getattr(torch.nn.functional, call)(-torch.ones(1, 2, 4, 4), training=True)
        line = sys._getframe().f_lineno - 1
    assert (TORCH,) == moved(before, snapshot())
    assert f"F.{call} at {__file__}:{line}" == escape_since(count)
    assert "" == escape_since(escapes_noted())  # none since


def test_the_routing_functions_pickle_as_the_originals_do() -> None:
    """A dataset holding random.random (or a partial of it) still pickles (spawned workers)."""
    import functools
    import pickle

    install()
    for function in (random.random, np.random.uniform, np.random.sample):
        assert function is pickle.loads(pickle.dumps(function))
    scaled = pickle.loads(pickle.dumps(functools.partial(np.random.uniform, 0.0)))
    assert 0.0 <= scaled(1.0) < 1.0


def test_a_samples_first_numpy_draw_is_routed_where_numpy_random_was_not_imported_yet() -> None:
    """A first routed draw is the sample's own where numpy.random was not imported yet.

    In a fresh process where NumPy is imported and its random module is not (NumPy 2 loads it
    lazily): left to be imported inside the first sample, its draws went to NumPy's global
    generator.
    """
    program = (
        "import sys, numpy as np, torch\n"
        "assert 'numpy.random.mtrand' not in sys.modules\n"
        "from nostall._loading.own_draws import SampleRng, install, routed\n"
        "install()\n"
        "with routed(SampleRng(1)):\n"
        "    a = np.random.rand()\n"
        "with routed(SampleRng(1)):\n"
        "    b = np.random.rand()\n"
        "print(a == b)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120
    )
    assert (0, "True") == (out.returncode, out.stdout.strip()), out.stderr
