"""Interpreter exit and Ctrl-C with a live producer, each in a subprocess with a timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

PRELUDE = """
import signal, sys, time, threading
# A process started in the background of a non-interactive shell inherits SIGINT ignored, and
# Python then installs no KeyboardInterrupt handler: put it back, as an interactive run has it.
signal.signal(signal.SIGINT, signal.default_int_handler)
import torch
from torch.utils.data import DataLoader
import nostall

class Slow:
    # A source whose __next__ takes `delay` seconds per batch.
    def __init__(self, delay):
        self.delay = delay
    def __iter__(self):
        i = 0
        while True:
            time.sleep(self.delay)
            yield torch.tensor([i])
            i += 1
"""


def run_script(body: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    code = PRELUDE + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, check=False
    )


def assert_clean(done: subprocess.CompletedProcess[str]) -> None:
    assert "Fatal Python error" not in done.stderr, done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr


@pytest.mark.parametrize("workers", [0, 2])
def test_break_after_first_batch_then_exit(workers: int) -> None:
    """break, then the script ends: exit 0, promptly."""
    start = time.monotonic()
    done = run_script(f"""
        loader = DataLoader(range(10_000), batch_size=4, num_workers={workers})
        for batch in nostall.prefetch(loader):
            break
        print("done")
    """)
    assert_clean(done)
    assert 0 == done.returncode, done.stderr
    assert "done" in done.stdout
    assert time.monotonic() - start < 30


def test_live_iteration_at_exit() -> None:
    """An iteration kept alive in a global when the script ends: the exit hook stops it."""
    done = run_script("""
        loader = DataLoader(range(10_000), batch_size=4, num_workers=2)
        it = iter(nostall.prefetch(loader))
        next(it)
        print("leaving")
    """)
    assert_clean(done)
    assert 0 == done.returncode, done.stderr


@pytest.mark.parametrize(
    "source",
    ["Slow(60)", "DataLoader(Sleeps(), batch_size=2)"],
    ids=["producer", "loading-thread"],
)
def test_a_thread_waiting_in_c_at_exit_does_not_hold_the_process(source: str) -> None:
    """A thread inside a long sleep at exit: exit does not wait out its whole second wait.

    It uses no CPU time: exit takes it to wait in C, as a stuck worker process waits, and
    leaves it well before INTERRUPT_WAIT_S (60 s here) runs out.
    """
    threads = ", threads=2" if "DataLoader" in source else ""
    start = time.monotonic()
    done = run_script(f"""
        import nostall._exit
        nostall._exit.INTERRUPT_WAIT_S = 60.0
        class Sleeps(torch.utils.data.Dataset):
            def __len__(self):
                return 8
            def __getitem__(self, i):
                time.sleep(60)
                return i
        it = iter(nostall.prefetch({source}, timeout=0.2{threads}))
        try:
            next(it)
        except TimeoutError:
            print("timed out")
    """)
    assert_clean(done)
    assert 0 == done.returncode, done.stderr
    assert "timed out" in done.stdout
    assert time.monotonic() - start < 30


def test_an_exit_handler_registered_before_the_import_loads_with_threads() -> None:
    """Its handler runs after nostall's: a threads= epoch there loads every batch, no hang."""
    code = textwrap.dedent("""
        import atexit
        def at_exit():
            from torch.utils.data import DataLoader
            import nostall
            for epoch in range(2):
                print([b.tolist() for b in nostall.prefetch(DataLoader(range(8), batch_size=2),
                                                            threads=2)])
        atexit.register(at_exit)
        import nostall
        from torch.utils.data import DataLoader
        print([b.tolist() for b in nostall.prefetch(DataLoader(range(4), batch_size=2),
                                                    threads=2)])
    """)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert_clean(done)
    assert 0 == done.returncode, done.stderr
    epoch = "[[0, 1], [2, 3], [4, 5], [6, 7]]"
    assert ["[[0, 1], [2, 3]]", epoch, epoch] == done.stdout.splitlines()


def test_exception_in_the_loop() -> None:
    """An uncaught exception in the training loop: exit 1 with the user's traceback."""
    done = run_script("""
        for batch in nostall.prefetch(DataLoader(range(100), batch_size=2, num_workers=2)):
            raise RuntimeError("loss is nan")
    """)
    assert_clean(done)
    assert 1 == done.returncode
    assert "RuntimeError: loss is nan" in done.stderr


def test_sys_exit_in_the_loop() -> None:
    """sys.exit(3) mid-epoch: exit code 3."""
    done = run_script("""
        for batch in nostall.prefetch(Slow(0.01)):
            sys.exit(3)
    """)
    assert_clean(done)
    assert 3 == done.returncode


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child is POSIX")
def test_ctrl_c_during_next() -> None:
    """SIGINT while the consumer waits: KeyboardInterrupt promptly, and the producer stops."""
    code = PRELUDE + textwrap.dedent("""
        def pulled_slowly():
            for i in range(3):
                print("pulling", flush=True)  # next(it) below is under way
                time.sleep(2.0)
                yield torch.tensor([i])

        it = iter(nostall.prefetch(pulled_slowly()))
        start = time.monotonic()
        try:
            next(it)
        except KeyboardInterrupt:
            print(f"interrupted after {time.monotonic() - start:.2f}", flush=True)
        try:
            next(it)
        except nostall.PrefetcherClosedError as e:
            print("closed:", e, flush=True)
        deadline = time.monotonic() + 10
        while any(t.name.startswith("nostall-") for t in threading.enumerate()):
            if time.monotonic() > deadline:
                print("producer still alive", flush=True)
                break
            time.sleep(0.01)
        else:
            print("producer stopped", flush=True)
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert "pulling" == proc.stdout.readline().strip()  # the child is inside next(it)
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert "Fatal Python error" not in err
    assert 0 == proc.returncode, err
    interrupted = [line for line in out.splitlines() if line.startswith("interrupted after")]
    assert interrupted, out
    assert float(interrupted[0].split()[-1]) < 1.5  # the source's next() takes 2 s
    assert "interrupted by KeyboardInterrupt" in out
    assert "producer stopped" in out


# -- the process the prefetcher lives in ------------------------------------------------------


def test_intra_op_threads_of_the_training_thread_are_kept() -> None:
    """The producer's one intra-op thread does not leak into the training thread."""
    body = """
        import os
        if {prefetch}:
            for batch in nostall.prefetch(DataLoader(range(8), batch_size=2), "cpu"):
                pass
        seen = []
        worker = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        worker.start(); worker.join()
        print(torch.get_num_threads(), seen[0])
    """
    plain = run_script(body.format(prefetch=False))
    prefetched = run_script(body.format(prefetch=True))
    assert 0 == prefetched.returncode, prefetched.stderr
    assert plain.stdout.split() == prefetched.stdout.split()


def test_iterating_after_fork_says_so() -> None:
    """A prefetcher started before fork() fails in the child with a message about fork."""
    done = run_script("""
        import os
        p = nostall.prefetch(DataLoader(range(8), batch_size=2), "cpu")
        it = iter(p)
        next(it)
        pid = os.fork()
        if pid == 0:
            try:
                next(it)
            except nostall.PrefetcherClosedError as e:
                print("child:", "fork()" in str(e), "bug in nostall" not in str(e), flush=True)
            try:
                list(p)
            except nostall.PrefetcherClosedError as e:
                print("child iter:", "fork()" in str(e), flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        print("parent:", next(it).tolist())
    """)
    assert 0 == done.returncode, done.stderr
    assert "child: True True" in done.stdout
    assert "child iter: True" in done.stdout
    assert "parent: [2, 3]" in done.stdout  # the parent goes on


def test_worker_killed_by_a_signal_arrives_with_a_note() -> None:
    """PyTorch's error for a killed worker reaches the user, noted like every other error."""
    done = run_script("""
        import os, signal, traceback
        import torch.utils.data._utils as data_utils
        data_utils.MP_STATUS_CHECK_INTERVAL = 0.2

        class Killer(torch.utils.data.Dataset):
            def __len__(self):
                return 64
            def __getitem__(self, i):
                if i == 6:
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(0.02)
                return i

        loader = DataLoader(Killer(), batch_size=2, num_workers=1)
        first = None
        try:
            try:
                for batch in nostall.prefetch(loader, "cpu"):
                    pass
            except Exception as e:
                first = e
                # torch's SIGCHLD handler raises the dead worker's error into this thread
                # wherever it is, once: here it may not interrupt the report below.
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        except Exception as late:  # the handler raised while the loop's error was caught
            first = first or late.__context__ or late
        try:
            # PyTorch's own error, one of three by timing: the worker was killed or exited
            # unexpectedly; or it died while handing a batch's shared memory over, before
            # torch saw it dead, and the fd-sharing connection was reset or ended (EOFError).
            e = first
            dead = e is not None and "DataLoader worker" in str(e)
            print("error:", dead or isinstance(e, (ConnectionError, EOFError)), repr(e))
            frames = traceback.extract_tb(e.__traceback__) if e is not None else []
            # Raised by torch's handler straight into the loop body: nostall never held it.
            in_loop = bool(frames) and frames[-1].filename.endswith("signal_handling.py") and (
                not any("nostall" in f.filename for f in frames)
            )
            noted = any("nostall:" in n for n in getattr(e, "__notes__", []))
            print("noted:", noted or in_loop)
        finally:
            # What would come next is torch's teardown of a loader whose worker was SIGKILLed,
            # which can print errors from its connections during finalisation: not under test.
            sys.stdout.flush()
            os._exit(0)
    """)
    assert 0 == done.returncode, done.stderr
    assert "error: True" in done.stdout, done.stdout + done.stderr
    assert "noted: True" in done.stdout, done.stdout + done.stderr


def test_ctrl_c_anywhere_in_next_stops_the_iteration() -> None:
    """KeyboardInterrupt anywhere in next() stops the iteration and its producer.

    Here it lands just after the producer thread started, inside the epoch's start (where a
    Ctrl-C under load once left the producer running); the next next() says why.
    """
    done = run_script("""
        original_start = threading.Thread.start
        where = {"now": ""}

        def start(self):
            original_start(self)
            if where["now"] == "thread start" and self.name.startswith("nostall-"):
                raise KeyboardInterrupt

        threading.Thread.start = start

        for case in ("thread start",):
            where["now"] = case
            it = iter(nostall.prefetch(Slow(0.5), "cpu"))
            try:
                next(it)
                print(case, "no interrupt", flush=True)
            except KeyboardInterrupt:
                pass
            try:
                next(it)
                print(case, "a batch after the interrupt", flush=True)
            except nostall.PrefetcherClosedError as e:
                print(case, "closed:", "KeyboardInterrupt" in str(e), flush=True)
            deadline = time.monotonic() + 10
            while any(t.name.startswith("nostall-") for t in threading.enumerate()):
                if time.monotonic() > deadline:
                    print(case, "producer still alive", flush=True)
                    break
                time.sleep(0.01)
    """)
    assert_clean(done)
    assert 0 == done.returncode, done.stderr
    assert "thread start closed: True" in done.stdout, done.stdout
    assert "still alive" not in done.stdout, done.stdout


def test_exit_waits_for_every_tracked_thread() -> None:
    """A thread still finishing when exit comes is joined (within the deadline), not cut off."""
    import threading

    from nostall._exit import join_tracked, track

    release = threading.Event()
    thread = track(threading.Thread(target=release.wait, args=(30,), daemon=True))
    thread.start()
    threading.Timer(0.2, release.set).start()
    join_tracked(time.monotonic() + 30)
    assert not thread.is_alive()


TORCH_OPS_FOREVER = """
entered = threading.Event()

class Augment(torch.utils.data.Dataset):
    # Samples 0 and 1 are quick; every later one runs short torch ops (which release the GIL)
    # forever, as a long augmentation still running when the script ends. (Under threads=2 the
    # first batch waits for the 2 samples fetched on trial: see nostall._loading.threads.)
    def __len__(self):
        return 1000
    def __getitem__(self, i):
        x = torch.ones(3, 32, 32)
        if i < 2:
            return x
        entered.set()
        while True:
            x = torch.nn.functional.avg_pool2d(x, 3, 1, 1)
"""


@pytest.mark.parametrize("threads", [None, 2])
def test_exit_status_kept_while_a_thread_runs_torch_ops(threads: int | None) -> None:
    """sys.exit(3) while a producer or loading thread is inside torch ops: status 3, no abort.

    A daemon thread coming back from a torch op during finalisation aborted the process
    ("terminate called without an active exception", status -6).
    """
    done = run_script(
        TORCH_OPS_FOREVER
        + f"""
loader = DataLoader(Augment(), batch_size=1)
for batch in nostall.prefetch(loader, threads={threads}):
    assert entered.wait(60), "the next sample never started"  # fetched ahead, in a thread
    break
print("leaving", flush=True)
sys.exit(3)
""",
        timeout=120,
    )
    assert_clean(done)
    assert "terminate called" not in done.stderr, done.stderr
    assert 3 == done.returncode, done.stderr[-3000:]
    assert "leaving" in done.stdout


def test_exit_interrupts_a_thread_that_catches_the_interrupt_once() -> None:
    """A thread that swallows the first interrupt is interrupted again until it ends."""
    done = run_script("""
from nostall._exit import track, wind_down

caught = []

def stubborn():
    for _ in range(2):  # swallows the first interrupt; the second ends it
        try:
            while True:
                torch.ones(8).add_(1)
        except BaseException as e:
            caught.append(type(e).__name__)

thread = track(threading.Thread(target=stubborn, daemon=True))
thread.start()
left = wind_down(polite_s=0.0, interrupt_s=60.0)
print("left", len(left), "caught", caught)
""")
    assert_clean(done)
    assert 0 == done.returncode, done.stderr[-3000:]
    assert "left 0 caught ['ThreadLetGo', 'ThreadLetGo']" in done.stdout, done.stdout
