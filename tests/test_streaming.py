"""Streaming datasets: webdataset, Hugging Face ``datasets`` and plain shard readers.

Each is compared with its own loader without nostall (same samples, same order), with worker
processes and without; a resume that cannot be exact is warned of at the user's line; and
``threads=`` over a stream loads it as worker processes would (see test_threaded_stream).
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same_batches
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

import nostall

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

wds = pytest.importorskip("webdataset")
datasets = pytest.importorskip("datasets")

# webdataset leaves a shard's file to the garbage collector when an epoch is left mid-way (a
# resume test saves its state so): with or without nostall, that file is reported unclosed.
pytestmark = pytest.mark.filterwarnings("ignore:unclosed file:ResourceWarning")

ROOT = Path(__file__).resolve().parent.parent
SHARDS, PER_SHARD = 4, 6


def write_shards(folder: Path) -> list[str]:
    """Four tar shards of six samples each: a tensor ``x.pth`` and a class ``cls``."""
    folder.mkdir(parents=True, exist_ok=True)
    urls = []
    for s in range(SHARDS):
        url = str(folder / f"shard-{s:02d}.tar")
        with wds.TarWriter(url) as sink:
            for i in range(PER_SHARD):
                k = s * PER_SHARD + i
                sink.write({"__key__": f"{k:04d}", "x.pth": torch.tensor([k, 2 * k]), "cls": k % 3})
        urls.append(url)
    return urls


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return write_shards(tmp_path_factory.mktemp("shards"))


def epochs(loader: Any, count: int = 2) -> list[Any]:
    """Every batch of ``count`` epochs, in order."""
    return [batch for _ in range(count) for batch in loader]


class ShardReader(IterableDataset[torch.Tensor]):
    """The plain way to stream shards: each DataLoader worker reads every num_workers-th one."""

    def __init__(self, shards: int, per_shard: int) -> None:
        self.shards, self.per_shard = shards, per_shard

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        mine = range(self.shards) if info is None else range(info.id, self.shards, info.num_workers)
        for shard in mine:
            for i in range(self.per_shard):
                yield torch.tensor([shard, i])


# --- same samples, same order --------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_plain_shard_reader_split_across_workers_keeps_its_order(num_workers: int) -> None:
    """An IterableDataset splitting shards by get_worker_info(): the plain loader's batches."""
    loader = DataLoader(ShardReader(4, 5), batch_size=3, num_workers=num_workers)
    assert_same_batches(epochs(loader), epochs(nostall.prefetch(loader)))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_webdataset_pipeline_keeps_its_order(shards: list[str], num_workers: int) -> None:
    """WebDataset -> decode -> seeded shuffle -> batched, in a DataLoader: same batches."""
    dataset = (
        wds.WebDataset(shards, shardshuffle=False)
        .decode()
        .to_tuple("x.pth", "cls")
        .shuffle(8, seed=3)
        .batched(4)
    )
    loader = DataLoader(
        dataset, batch_size=None, num_workers=num_workers, persistent_workers=num_workers > 0
    )
    expected = epochs(loader)
    assert len(expected) == 2 * SHARDS * PER_SHARD // 4
    assert_same_batches(expected, epochs(nostall.prefetch(loader, across_epochs=True)))


def test_a_webloader_rebatching_across_workers_keeps_its_order(shards: list[str]) -> None:
    """WebLoader's fluid interface (unbatch, shuffle, batch again after the workers)."""

    def webloader() -> Any:
        dataset = wds.WebDataset(shards, shardshuffle=False).decode().to_tuple("x.pth", "cls")
        loader = wds.WebLoader(dataset.batched(4), batch_size=None, num_workers=2)
        return loader.unbatched().shuffle(6, seed=1).batched(5)

    expected = epochs(webloader())
    assert_same_batches(expected, epochs(nostall.prefetch(webloader())))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_hf_dataset_with_torch_format_keeps_its_order(num_workers: int) -> None:
    """Dataset.with_format("torch") behind a shuffling DataLoader with a seeded generator."""
    table = datasets.Dataset.from_dict({"x": [[i, 2 * i] for i in range(20)], "y": list(range(20))})
    dataset = table.with_format("torch")

    def loader() -> DataLoader[Any]:
        generator = torch.Generator().manual_seed(0)
        return DataLoader(
            dataset, batch_size=4, shuffle=True, generator=generator, num_workers=num_workers
        )

    assert_same_batches(epochs(loader()), epochs(nostall.prefetch(loader())))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_hf_iterable_dataset_follows_set_epoch(num_workers: int) -> None:
    """to_iterable_dataset().shuffle(seed=...): set_epoch on the prefetcher reaches it."""
    table = datasets.Dataset.from_dict({"x": [[i, 2 * i] for i in range(24)], "y": list(range(24))})
    stream = table.to_iterable_dataset(num_shards=4).with_format("torch")
    stream = stream.shuffle(seed=1, buffer_size=8)
    loader = DataLoader(stream, batch_size=4, num_workers=num_workers)
    expected: list[dict[str, torch.Tensor]] = []
    for epoch in range(2):
        stream.set_epoch(epoch)
        expected.extend(loader)
    # The epochs differ, so following set_epoch matters.
    assert [b["y"].tolist() for b in expected[:6]] != [b["y"].tolist() for b in expected[6:]]
    prefetcher = nostall.prefetch(loader)
    actual: list[dict[str, torch.Tensor]] = []
    for epoch in range(2):
        prefetcher.set_epoch(epoch)
        actual.extend(prefetcher)
    assert_same_batches(expected, actual)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_hf_stream_split_by_node_keeps_each_ranks_share(rank: int) -> None:
    """datasets.distributed.split_dataset_by_node: each rank's batches, with two workers."""
    from datasets.distributed import split_dataset_by_node

    table = datasets.Dataset.from_dict({"y": list(range(24))})
    stream = split_dataset_by_node(table.to_iterable_dataset(num_shards=4), rank, world_size=2)
    loader = DataLoader(stream.with_format("torch"), batch_size=4, num_workers=2)
    expected = epochs(loader, 1)
    assert 12 == sum(len(b["y"]) for b in expected)
    assert_same_batches(expected, epochs(nostall.prefetch(loader), 1))


# --- resume over webdataset's shuffle ----------------------------------------------------


def seeded_pipeline(shards: list[str], **shuffle: Any) -> Any:
    dataset = wds.WebDataset(shards, shardshuffle=False).decode().to_tuple("__key__", "cls")
    return dataset.shuffle(8, **shuffle).batched(4)


def keys(batches: list[Any]) -> list[list[str]]:
    return [list(batch[0]) for batch in batches]


def state_after(loader: Any, epoch: int, batches: int) -> dict[str, Any]:
    """The prefetcher's state after ``batches`` batches of ``epoch`` (counted from 0)."""
    prefetcher = nostall.prefetch(loader)
    for _ in range(epoch):
        for _ in prefetcher:
            pass
    it = iter(prefetcher)
    for _ in range(batches):
        next(it)
    state = prefetcher.state_dict()
    prefetcher.close()
    return state


def test_resuming_mid_epoch_over_an_unseeded_shuffle_warns_at_the_users_line(
    shards: list[str],
) -> None:
    """.shuffle(n) seeds itself from the pid and the time: the resume cannot be exact."""
    state = state_after(DataLoader(seeded_pipeline(shards), batch_size=None), 0, 2)
    fresh = nostall.prefetch(DataLoader(seeded_pipeline(shards), batch_size=None))
    with pytest.warns(UserWarning, match=r"shuffle\(8\).*process id and the time") as caught:
        fresh.load_state_dict(state)
    assert 1 == len(caught)
    assert __file__ == caught[0].filename
    message = str(caught[0].message)
    assert "some twice in this epoch and some never" in message
    assert ".shuffle(n, seed=s)" in message


def test_resuming_at_an_epochs_start_over_an_unseeded_shuffle_is_quiet(shards: list[str]) -> None:
    """Nothing is dropped, and no run draws that order twice: nothing to warn of."""
    state = state_after(DataLoader(seeded_pipeline(shards), batch_size=None), 0, 0)
    fresh = nostall.prefetch(DataLoader(seeded_pipeline(shards), batch_size=None))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh.load_state_dict(state)


def test_a_shared_rng_resumed_in_a_later_epoch_warns(shards: list[str]) -> None:
    """.shuffle(n, rng=Random(s)) goes on from epoch to epoch; a fresh process starts over."""
    state = state_after(
        DataLoader(seeded_pipeline(shards, rng=random.Random(5)), batch_size=None), 1, 2
    )
    fresh = nostall.prefetch(
        DataLoader(seeded_pipeline(shards, rng=random.Random(5)), batch_size=None)
    )
    with pytest.warns(UserWarning, match=r"epoch 1 .*rng goes on from epoch to epoch"):
        fresh.load_state_dict(state)


def test_a_shared_rng_copied_into_fresh_workers_each_epoch_is_quiet(shards: list[str]) -> None:
    """Workers without persistent_workers start every epoch from the rng as built."""

    def loader() -> DataLoader[Any]:
        pipeline = seeded_pipeline(shards, rng=random.Random(5))
        return DataLoader(pipeline, batch_size=None, num_workers=2)

    state = state_after(loader(), 1, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nostall.prefetch(loader()).load_state_dict(state)


def detshuffled(shards: list[str], epoch: int = -1) -> DataLoader[Any]:
    dataset = wds.WebDataset(shards, shardshuffle=False).decode().to_tuple("__key__", "cls")
    stage = wds.detshuffle(8, seed=2, epoch=epoch)
    return DataLoader(dataset.compose(stage).batched(4), batch_size=None)


def test_a_detshuffle_resumed_in_a_later_epoch_warns(shards: list[str]) -> None:
    """detshuffle counts epochs in its own object: a fresh one draws epoch 1 as epoch 0."""
    state = state_after(detshuffled(shards), 1, 2)
    with pytest.warns(UserWarning, match=r"detshuffle\(8, seed=2\) \(it counts epochs from 0"):
        nostall.prefetch(detshuffled(shards)).load_state_dict(state)


def test_a_detshuffle_built_with_the_previous_epoch_resumes_exactly(shards: list[str]) -> None:
    """The fix the warning names for detshuffle: epoch=e - 1 in the resumed run."""
    uninterrupted = keys(epochs(detshuffled(shards), 2))
    per_epoch = len(uninterrupted) // 2
    assert uninterrupted[:per_epoch] != uninterrupted[per_epoch:]  # a new order each epoch
    state = state_after(detshuffled(shards), 1, 2)
    resumed = nostall.prefetch(detshuffled(shards, epoch=0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.load_state_dict(state)
    assert uninterrupted[per_epoch + 2 :] == keys(list(resumed))


def test_a_stateful_loader_over_an_unseeded_shuffle_gets_the_specific_warning_once(
    shards: list[str],
) -> None:
    """torchdata's StatefulDataLoader replays the pipeline too: the shuffle is named, once."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    loader = stateful.StatefulDataLoader(seeded_pipeline(shards), batch_size=None)
    state = state_after(loader, 0, 2)
    fresh = nostall.prefetch(stateful.StatefulDataLoader(seeded_pipeline(shards), batch_size=None))
    with pytest.warns(UserWarning, match=r"webdataset pipeline") as caught:
        fresh.load_state_dict(state)
    assert 1 == len(caught)  # not also the general one about its IterableDataset
    assert "shuffle(8) (seeded from the process id and the time)" in str(caught[0].message)
    assert __file__ == caught[0].filename


RESUME = """
import json, sys, torch, webdataset as wds, warnings
from torch.utils.data import DataLoader
import nostall
shards = json.loads(sys.argv[1])
dataset = wds.WebDataset(shards, shardshuffle=False).decode().to_tuple("__key__", "cls")
loader = DataLoader(dataset.shuffle(8, seed=7).batched(4), batch_size=None)
prefetcher = nostall.prefetch(loader)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    prefetcher.load_state_dict(torch.load(sys.argv[2], weights_only=False))
seen = [list(batch[0]) for _ in range(2) for batch in prefetcher]
print(json.dumps({"warnings": [str(w.message) for w in caught], "keys": seen}))
"""


def test_a_seeded_shuffle_resumes_mid_epoch_exactly_in_a_fresh_process(
    shards: list[str], tmp_path: Path
) -> None:
    """.shuffle(n, seed=s), the fix the warning names: the rest of the run, batch for batch."""

    def loader() -> DataLoader[Any]:
        return DataLoader(seeded_pipeline(shards, seed=7), batch_size=None)

    uninterrupted = keys(epochs(loader(), 3))
    per_epoch = len(uninterrupted) // 3
    state = state_after(loader(), 1, 2)  # resumes inside epoch 1
    torch.save(state, tmp_path / "state.pt")
    done = subprocess.run(
        [sys.executable, "-c", RESUME, json.dumps(shards), str(tmp_path / "state.pt")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert 0 == done.returncode, done.stderr
    resumed = json.loads(done.stdout.splitlines()[-1])
    assert [] == resumed["warnings"]
    # The rest of epoch 1, then epoch 2 (the resumed loop's second pass).
    assert uninterrupted[per_epoch + 2 :] == resumed["keys"]


# --- threads= over a stream: the refusals that lead somewhere ---------------------------


def test_threads_over_a_streaming_loader_with_workers_says_to_build_it_without() -> None:
    """num_workers=2 and threads=: the fix is num_workers=0, and following it loads the same."""
    loader = DataLoader(ShardReader(4, 5), batch_size=3, num_workers=2)
    with pytest.raises(ValueError, match=r"num_workers=2: build it with num_workers=0"):
        nostall.prefetch(loader, threads=2)
    # Following it: two threads read the stream as the two worker processes did.
    without = DataLoader(ShardReader(4, 5), batch_size=3)
    assert_same_batches(epochs(loader, 1), epochs(nostall.prefetch(without, threads=2), 1))


def test_threads_over_a_hf_stream_with_workers_says_to_build_it_without() -> None:
    """The same for a Hugging Face IterableDataset behind a DataLoader with workers."""
    table = datasets.Dataset.from_dict({"y": list(range(8))})
    loader = DataLoader(table.to_iterable_dataset(num_shards=2), batch_size=2, num_workers=2)
    with pytest.raises(ValueError, match=r"build it with num_workers=0"):
        nostall.prefetch(loader, threads=2)


def test_threads_over_a_webloader_says_to_leave_threads_out(shards: list[str]) -> None:
    """A WebLoader is a pipeline, not a DataLoader: not "pass the DataLoader itself"."""
    dataset = wds.WebDataset(shards, shardshuffle=False).to_tuple("cls").batched(2)
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=2)
    with pytest.raises(TypeError, match=r"IterableDataset.*leave threads out") as refused:
        nostall.prefetch(loader, threads=2)
    assert "DataLoader itself" not in str(refused.value)


# --- the docs pages run ------------------------------------------------------------------


def python_blocks(page: Path) -> str:
    """The page's ```python blocks, in order, as one script."""
    return "\n".join(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL))


@pytest.mark.parametrize("page", ["webdataset.md", "hf-datasets.md"])
def test_the_client_page_runs(
    page: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The code on docs/clients/<page>, run as a user runs it, in an empty folder.

    Run here, as one script with globals of its own, its warnings errors: a process of its
    own cost an interpreter and the imports of torch and the library again (most of its time).
    """
    script = python_blocks(ROOT / "docs" / "clients" / page)
    assert "nostall.prefetch(" in script
    monkeypatch.chdir(tmp_path)
    names: dict[str, Any] = {"__name__": "__main__"}
    with torch.random.fork_rng(devices=[]):
        exec(compile(script, f"docs/clients/{page}", "exec"), names)
    names.clear()  # its prefetchers and loaders, before the check that their threads ended
    assert "same batches as the plain loader" in capsys.readouterr().out


def test_threads_load_a_hf_map_style_dataset_as_its_loader_does() -> None:
    """What the threads= refusal points to for HF data: a map-style Dataset loads in threads."""
    table = datasets.Dataset.from_dict({"x": [[i, 2 * i] for i in range(20)], "y": list(range(20))})

    def loader() -> DataLoader[Any]:
        generator = torch.Generator().manual_seed(0)
        dataset = table.with_format("torch")
        return DataLoader(dataset, batch_size=4, shuffle=True, generator=generator)

    assert_same_batches(epochs(loader()), epochs(nostall.prefetch(loader(), threads=2)))
