"""nostall.transforms against references written here, on CPU (and CUDA where present)."""

from __future__ import annotations

import io
import math
import re
from collections import namedtuple
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import assert_same_batches, cpu_peak_bytes, cuda_peak_bytes, wait_until
from simcuda import Kind, simulated_cuda

import nostall
from nostall import transforms as T
from nostall.transforms import _tensors

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def images(n: int = 4, h: int = 6, w: int = 7, seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, 256, (n, 3, h, w), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def test_to_dtype_scales_integers() -> None:
    """uint8 to float: divided by 255; float to float: unchanged values."""
    x = images()
    out = T.ToDtype(torch.float32)(x)
    assert torch.float32 == out.dtype
    torch.testing.assert_close(out.double(), x.double() / 255, atol=1e-6, rtol=0)
    assert torch.equal(T.ToDtype(torch.float16, scale=False)(x), x.half())


def test_normalize_fused_matches_the_reference() -> None:
    """Cast, scale and normalise in one pass equals ((x / 255) - mean) / std."""
    x = images()
    mean = torch.tensor(MEAN, dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor(STD, dtype=torch.float64).view(1, 3, 1, 1)
    reference = (x.double() / 255 - mean) / std
    out = T.Normalize(MEAN, STD)(x)
    assert torch.float32 == out.dtype
    torch.testing.assert_close(out.double(), reference, atol=1e-6, rtol=0)
    for dtype in (torch.bfloat16, torch.float16):  # rounded once: the correctly rounded value
        half = T.Normalize(MEAN, STD, dtype=dtype)(images(n=40, seed=1))
        assert torch.equal(half, ((images(n=40, seed=1).double() / 255 - mean) / std).to(dtype))


def test_normalize_float_input_keeps_its_dtype_and_input() -> None:
    """A float input is normalised into a new tensor; the input is untouched."""
    x = images().float() / 255
    before = x.clone()
    out = T.Normalize(MEAN, STD)(x)
    assert torch.equal(before, x)
    expected = (x - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    torch.testing.assert_close(out, expected)


def test_normalize_rejects_bad_input() -> None:
    """Channel count and std are checked, with the shape in the message."""
    with pytest.raises(ValueError, match=r"has 3 channels but the images are \(2, 4, 3, 3\)"):
        T.Normalize(MEAN, STD)(torch.zeros(2, 4, 3, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="every std must be > 0"):
        T.Normalize((0.5,), (0.0,))


def test_channels_last() -> None:
    """Same values, channels-last memory."""
    x = images().float()
    out = T.ChannelsLast()(x)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(x, out)


def test_flip_matches_a_per_image_reference() -> None:
    """Each image is mirrored exactly when its draw from the seeded generator says so."""
    x = images(n=16)
    out = T.RandomHorizontalFlip(0.5, seed=3)(x)
    draws = torch.rand(16, generator=torch.Generator().manual_seed(3)) < 0.5
    for i in range(16):
        expected = x[i].flip(-1) if draws[i] else x[i]
        assert torch.equal(expected, out[i])
    assert 0 < int(draws.sum()) < 16  # both cases were exercised


def test_random_transforms_are_reproducible() -> None:
    """Same seed, same batches; reset() starts over; another seed differs."""
    x = images(n=32)
    a, b = T.RandomHorizontalFlip(seed=1), T.RandomHorizontalFlip(seed=1)
    first = [a(x), a(x)]
    assert all(torch.equal(p, q) for p, q in zip(first, [b(x), b(x)], strict=True))
    a.reset()
    assert torch.equal(first[0], a(x))
    assert not torch.equal(first[0], T.RandomHorizontalFlip(seed=2)(x))


def bilinear_reference(
    image: torch.Tensor, box: list[float], size: tuple[int, int]
) -> torch.Tensor:
    """Border-clamped bilinear sampling of one (C, H, W) image, pixel centres aligned."""
    top, left, h, w = box
    channels, height, width = image.shape
    out = torch.empty(channels, *size, dtype=torch.float64)
    for oy in range(size[0]):
        for ox in range(size[1]):
            y = min(max(top + (oy + 0.5) * h / size[0] - 0.5, 0.0), height - 1.0)
            x = min(max(left + (ox + 0.5) * w / size[1] - 0.5, 0.0), width - 1.0)
            y0, x0 = math.floor(y), math.floor(x)
            y1, x1 = min(y0 + 1, height - 1), min(x0 + 1, width - 1)
            dy, dx = y - y0, x - x0
            out[:, oy, ox] = (
                image[:, y0, x0] * (1 - dy) * (1 - dx)
                + image[:, y0, x1] * (1 - dy) * dx
                + image[:, y1, x0] * dy * (1 - dx)
                + image[:, y1, x1] * dy * dx
            )
    return out


def test_random_resized_crop_matches_the_reference() -> None:
    """Every image equals border-clamped bilinear sampling of its drawn box."""
    x = images(n=6, h=9, w=11)
    crop = T.RandomResizedCrop((5, 4), scale=(0.2, 1.0), seed=7)
    out = crop(x)
    assert (6, 3, 5, 4) == tuple(out.shape)
    boxes = T.RandomResizedCrop((5, 4), scale=(0.2, 1.0), seed=7).boxes(6, 9, 11)
    for i in range(6):
        box = boxes[i].tolist()
        assert 0 <= box[0]
        assert box[0] + box[2] <= 9
        assert 0 <= box[1]
        assert box[1] + box[3] <= 11
        expected = bilinear_reference(x[i].double() / 255, box, (5, 4))
        torch.testing.assert_close(out[i].double(), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("transform", "slack"),
    [
        (T.Normalize(MEAN, STD), 1.0),
        (T.Normalize(MEAN, STD, dtype=torch.bfloat16), 1.25),  # CPU: temporaries, in parts
        (T.ToDtype(torch.float16), 1.0),
        (T.ChannelsLast(), 1.0),
        (T.RandomHorizontalFlip(), 1.05),  # plus an (N, W) index
        (T.RandomResizedCrop(32), 1.5),  # plus chunked buffers within half the output
        (T.RandomResizedCrop(32, dtype=torch.bfloat16), 1.5),  # float32 buffers, counted so
        (T.RandomResizedCrop(200), 1.5),  # upscaling: still chunked
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, float) else "",
)
def test_allocations_stay_within_the_output(transform: T.Transform, slack: float) -> None:
    """Peak CPU allocation per batch is the output (times ``slack``) plus a few small tensors.

    A 4x larger input as float32 (what converting the whole batch would hold) is 4x the
    output for the 2x-downscaling crop; the bound catches it.
    """
    x = images(n=64, h=64, w=64)
    transform(x)  # caches (Normalize's coefficients)
    peak, out = cpu_peak_bytes(lambda: transform(x))
    output = out.numel() * out.element_size()
    assert peak <= slack * output + 16384, (peak, output)


@pytest.mark.parametrize(
    ("transform", "slack"),
    [(T.RandomHorizontalFlip(), 1.05), (T.RandomResizedCrop(32), 1.5)],
    ids=lambda v: type(v).__name__ if not isinstance(v, float) else "",
)
def test_channels_last_allocations_stay_within_the_output(
    transform: T.Transform, slack: float
) -> None:
    """Keeping a channels-last layout costs no extra copy of the batch."""
    x = images(n=64, h=64, w=64).contiguous(memory_format=torch.channels_last)
    peak, out = cpu_peak_bytes(lambda: transform(x))
    assert out.is_contiguous(memory_format=torch.channels_last)
    output = out.numel() * out.element_size()
    assert peak <= slack * output + 16384, (peak, output)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_crop_of_a_small_batch_holds_one_images_buffers(dtype: torch.dtype) -> None:
    """Two 375x500 photos to 224: the documented bound, one image's float32 buffers.

    Source, grid and result of one image are ``(C*H*W + (C+2)*h*w) * 4`` bytes, more than
    half of this small batch's output; a chunk of both images would hold twice that.
    """
    x = images(n=2, h=375, w=500)
    peak, out = cpu_peak_bytes(lambda: T.RandomResizedCrop(224, dtype=dtype)(x))
    output = out.numel() * out.element_size()
    one_image = (3 * 375 * 500 + 5 * 224 * 224) * 4
    assert peak <= output + one_image + 16384, (peak, output, one_image)


def test_crop_in_chunks_equals_the_reference_for_every_image() -> None:
    """Chunking the batch (here two images a chunk) changes no value."""
    x = images(n=12, h=24, w=24, seed=3)
    out = T.RandomResizedCrop(24, scale=(0.3, 1.0), seed=5)(x)
    boxes = T.RandomResizedCrop(24, scale=(0.3, 1.0), seed=5).boxes(12, 24, 24)
    for i in range(12):
        expected = bilinear_reference(x[i].double() / 255, boxes[i].tolist(), (24, 24))
        torch.testing.assert_close(out[i].double(), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "make",
    [
        lambda: T.Normalize(MEAN, STD),
        lambda: T.ToDtype(torch.bfloat16),
        lambda: T.ChannelsLast(),
        lambda: T.RandomHorizontalFlip(seed=2),
        lambda: T.RandomResizedCrop(5, seed=2),
    ],
    ids=["Normalize", "ToDtype", "ChannelsLast", "RandomHorizontalFlip", "RandomResizedCrop"],
)
def test_channels_last_input_gives_the_same_values_and_layout(make: Any) -> None:
    """collate_uint8 hands HWC images over channels-last; every transform keeps them so."""
    x = images(n=5, h=8, w=9)
    channels_last = x.contiguous(memory_format=torch.channels_last)
    out = make()(channels_last)
    torch.testing.assert_close(out, make()(x), atol=0, rtol=0)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert not out.is_contiguous()  # channels-last, not both (C = 3, H, W > 1)


def test_nchw_input_stays_nchw() -> None:
    """Only ChannelsLast changes the layout of a plain NCHW batch."""
    x = images(n=5, h=8, w=9)
    for transform in [
        T.Normalize(MEAN, STD),
        T.ToDtype(torch.bfloat16),
        T.RandomHorizontalFlip(seed=2),
        T.RandomResizedCrop(5, seed=2),
    ]:
        assert transform(x).is_contiguous(), transform


def test_crop_boxes_follow_the_area_and_ratio_rule() -> None:
    """Areas within scale (up to rounding) and ratios within ratio, for many draws."""
    crop = T.RandomResizedCrop(8, scale=(0.3, 0.6), ratio=(0.5, 2.0), seed=0)
    boxes = crop.boxes(200, 64, 64)
    area = boxes[:, 2] * boxes[:, 3] / (64 * 64)
    assert float(area.min()) > 0.25
    assert float(area.max()) < 0.66
    aspect = boxes[:, 3] / boxes[:, 2]
    assert float(aspect.min()) > 0.45
    assert float(aspect.max()) < 2.2


def test_on_selects_a_key_or_an_index_and_keeps_the_rest() -> None:
    """Dicts, tuples and namedtuples keep their type; only the chosen part changes."""
    x, y = images(), torch.arange(4)
    d = T.Normalize(MEAN, STD, on="image")({"image": x, "label": y, "id": "a"})
    assert d["label"] is y
    assert "a" == d["id"]
    assert torch.float32 == d["image"].dtype
    t = T.ToDtype(torch.float32, on=0)((x, y))
    assert type(t) is tuple
    assert t[1] is y
    Pair = namedtuple("Pair", ["image", "label"])
    p = T.ToDtype(torch.float32)(Pair(x, y))
    assert type(p) is Pair
    assert p.label is y


def test_on_pointing_nowhere_is_a_clear_error() -> None:
    """A missing key says what was looked for."""
    with pytest.raises(ValueError, match="found nothing at 'img'"):
        T.ToDtype(torch.float32, on="img")({"image": images()})


def test_compose_applies_in_order() -> None:
    """Compose = one after the other."""
    x = images()
    composed = T.Compose([T.Normalize(MEAN, STD, on="image"), T.ChannelsLast(on="image")])
    out = composed({"image": x})["image"]
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out, T.Normalize(MEAN, STD)(x))


def test_prefetch_with_transform_equals_transforming_the_plain_batches() -> None:
    """transform= runs after the move, in order, seeded: the same as applying it by hand."""
    batches = [(images(seed=i), torch.tensor([i])) for i in range(6)]

    def pipeline() -> Any:
        return T.Compose([T.RandomHorizontalFlip(seed=5), T.Normalize(MEAN, STD)])

    by_hand = pipeline()
    expected = [by_hand(b) for b in batches]
    assert_same_batches(expected, nostall.prefetch(batches, "cpu", transform=pipeline()))


def _augment(seed: int = 5) -> T.Compose:
    return T.Compose(
        [
            T.RandomHorizontalFlip(seed=seed),
            T.RandomResizedCrop(4, seed=seed + 1),
            T.Normalize(MEAN, STD),
        ]
    )


def test_state_dict_continues_the_random_draws() -> None:
    """A fresh, identically built pipeline loaded with the state draws what the first would."""
    first = _augment()
    for i in range(3):
        first(images(seed=i))
    state = first.state_dict()
    resumed = _augment()
    resumed.load_state_dict(state)
    for i in range(3, 6):
        torch.testing.assert_close(resumed(images(seed=i)), first(images(seed=i)), atol=0, rtol=0)
    assert not torch.equal(_augment()(images(seed=9)), first(images(seed=9)))  # state matters


@pytest.mark.parametrize(
    ("other", "message"),
    [
        (lambda: _augment(seed=6), "seed=5, this one has seed=6"),
        (lambda: T.Compose([T.RandomHorizontalFlip(seed=5)]), "holds 3 transforms"),
        (
            lambda: T.Compose(
                [
                    T.RandomResizedCrop(4, seed=5),
                    T.RandomHorizontalFlip(seed=5),
                    T.Normalize(MEAN, STD),
                ]
            ),
            "not from a RandomResizedCrop",
        ),
        (lambda: T.Normalize(MEAN, STD), "not from a Normalize"),
    ],
    ids=["seed", "length", "order", "type"],
)
def test_a_state_from_other_transforms_is_refused(other: Any, message: str) -> None:
    """Clear errors that say what differs."""
    with pytest.raises(ValueError, match=message):
        other().load_state_dict(_augment().state_dict())


def test_prefetcher_checkpoint_resumes_the_transform_draws() -> None:
    """A checkpoint taken while batches were transformed ahead resumes the draws exactly.

    Resumed in a fresh prefetcher, the rest of the epoch equals the uninterrupted run's,
    crops and flips included.
    """
    batches = [images(n=3, h=8, w=8, seed=i) for i in range(10)]
    expected = list(nostall.prefetch(batches, "cpu", transform=_augment()))
    p = nostall.prefetch(batches, "cpu", depth=4, transform=_augment())
    it = iter(p)
    for i in range(4):
        torch.testing.assert_close(next(it), expected[i], atol=0, rtol=0)
    # The producer runs ahead: the pipeline's generators are past batch 4.
    puller = it._puller
    assert puller is not None  # the first next() started it
    wait_until(lambda: puller.pulled >= 6, "the producer transformed ahead")
    saved = io.BytesIO()
    torch.save(p.state_dict(), saved)
    p.close()
    saved.seek(0)
    state = torch.load(saved, weights_only=True)
    assert "transform" in state
    resumed = nostall.prefetch(batches, "cpu", transform=_augment())
    resumed.load_state_dict(state)
    assert_same_batches(expected[4:], resumed)
    # The control: without the transform state, the resumed draws differ.
    del state["transform"]
    fresh = nostall.prefetch(batches, "cpu", transform=_augment())
    fresh.load_state_dict(state)
    assert any(not torch.equal(a, b) for a, b in zip(expected[4:], list(fresh), strict=True))


def test_prefetcher_refuses_a_transform_state_that_does_not_fit() -> None:
    """At load_state_dict, not at the next epoch."""
    batches = [images(seed=i) for i in range(4)]
    p = nostall.prefetch(batches, "cpu", transform=_augment())
    next(iter(p))
    state = p.state_dict()
    p.close()
    other = nostall.prefetch(batches, "cpu", transform=_augment(seed=1))
    with pytest.raises(ValueError, match="seed=5, this one has seed=1"):
        other.load_state_dict(state)


Case = tuple[Callable[[], object], type[Exception], str]


def _assert_refused(cases: list[Case]) -> None:
    """Each construction raises ``error`` with a message matching ``pattern``.

    One test per transform, its cases in a loop: every test item costs the suite a garbage
    collection (conftest), and the failure names the case by its pattern.
    """
    for make, error, pattern in cases:
        with pytest.raises(error, match=pattern):
            make()


def test_crop_arguments_are_checked() -> None:
    """size, seed, dtype, scale and ratio: wrong types and wrong values."""
    _assert_refused(
        [
            (lambda: T.RandomResizedCrop(0), ValueError, r"size=\.\.\.\) must be > 0 \(got size=0"),
            (lambda: T.RandomResizedCrop((224, -1)), ValueError, "must be > 0"),
            (lambda: T.RandomResizedCrop(2.5), TypeError, "an int or a pair of ints"),  # type: ignore[arg-type]
            (lambda: T.RandomResizedCrop("224"), TypeError, "an int or a pair of ints"),  # type: ignore[arg-type]
            (lambda: T.RandomResizedCrop((224,)), TypeError, "an int or a pair of ints"),  # type: ignore[arg-type]
            (lambda: T.RandomResizedCrop(8, seed=1.0), TypeError, r"seed=\.\.\.\) must be an int"),  # type: ignore[arg-type]
            (lambda: T.RandomResizedCrop(8, dtype="float16"), TypeError, "must be a torch.dtype"),  # type: ignore[arg-type]
            (lambda: T.RandomResizedCrop(8, dtype=torch.uint8), ValueError, "floating-point"),
            (lambda: T.RandomResizedCrop(8, scale=(0.9, 0.1)), ValueError, "scale"),
            (lambda: T.RandomResizedCrop(8, ratio=(1.0,)), ValueError, "two numbers"),  # type: ignore[arg-type]
            (lambda: T.RandomResizedCrop(8, ratio=(0.0, 1.0)), ValueError, "ratio"),
        ]
    )


def test_flip_arguments_are_checked() -> None:
    """p is a probability; seed an int, never a bool."""
    _assert_refused(
        [
            (lambda: T.RandomHorizontalFlip(seed=True), TypeError, "must be an int"),
            (lambda: T.RandomHorizontalFlip(seed="0"), TypeError, "must be an int"),  # type: ignore[arg-type]
            (lambda: T.RandomHorizontalFlip(p="0.5"), TypeError, r"p=\.\.\.\) must be a number"),  # type: ignore[arg-type]
            (lambda: T.RandomHorizontalFlip(p=1.5), ValueError, "between 0 and 1"),
            (lambda: T.RandomHorizontalFlip(p=math.nan), ValueError, "between 0 and 1"),
        ]
    )


def test_normalize_arguments_are_checked() -> None:
    """mean and std: numbers, one of each per channel, finite, std > 0; a float dtype."""
    _assert_refused(
        [
            (lambda: T.Normalize(MEAN, STD, dtype="float16"), TypeError, "must be a torch.dtype"),  # type: ignore[arg-type]
            (lambda: T.Normalize(MEAN, STD, dtype=torch.int64), ValueError, "floating-point"),
            (lambda: T.Normalize("rgb", STD), TypeError, "sequence of numbers"),  # type: ignore[arg-type]
            (lambda: T.Normalize(torch.tensor(MEAN), STD), TypeError, "sequence of numbers"),  # type: ignore[arg-type]
            (lambda: T.Normalize(MEAN, (0.2, "x", 0.2)), TypeError, r"std\[1\]"),  # type: ignore[arg-type]
            (lambda: T.Normalize(MEAN, STD[:2]), ValueError, "3 means and 2 stds"),
            (lambda: T.Normalize(MEAN, (0.2, math.inf, 0.2)), ValueError, "finite"),
            (lambda: T.Normalize((math.nan,) * 3, STD), ValueError, "finite"),
            (lambda: T.Normalize(MEAN, (0.2, -0.1, 0.2)), ValueError, "every std must be > 0"),
        ]
    )


def test_to_dtype_and_compose_arguments_are_checked() -> None:
    """ToDtype: a dtype and a bool; Compose: a list of callables."""
    _assert_refused(
        [
            (lambda: T.ToDtype("float16"), TypeError, "must be a torch.dtype"),  # type: ignore[arg-type]
            (lambda: T.ToDtype(torch.float16, scale="yes"), TypeError, r"scale=\.\.\.\) must be"),  # type: ignore[arg-type]
            (lambda: T.Compose(T.ChannelsLast()), TypeError, "takes a list of transforms"),  # type: ignore[arg-type]
            (lambda: T.Compose([T.ChannelsLast(), "flip"]), TypeError, r"transforms\[1\]"),  # type: ignore[list-item]
        ]
    )


def test_on_is_checked() -> None:
    """on= is a dict key or a tuple index: not a list, not a bool (True would be index 1)."""
    _assert_refused(
        [
            (lambda: T.Normalize(MEAN, STD, on=["image"]), TypeError, r"on=\.\.\.\) names the"),  # type: ignore[arg-type]
            (lambda: T.ToDtype(torch.float16, on=True), TypeError, "got True, a bool"),
            (lambda: T.Compose([T.ChannelsLast()], on={}), TypeError, r"Compose\(on=\.\.\.\)"),  # type: ignore[arg-type]
            (lambda: T.RandomHorizontalFlip(on=[0]), TypeError, r"pass e\.g\. on='image' or on=0"),  # type: ignore[arg-type]
        ]
    )
    assert T.Compose([], on=None).on is None
    assert ("image", 1) == T.ChannelsLast(on=("image", 1)).on  # any hashable key


@pytest.mark.parametrize(
    "transform",
    [
        T.RandomHorizontalFlip(p=1.0),
        T.RandomResizedCrop(4),
        T.Normalize(MEAN, STD),
        T.ChannelsLast(),
    ],
    ids=lambda t: type(t).__name__,
)
def test_one_image_is_not_taken_for_a_batch(transform: T.Transform) -> None:
    """A (C, H, W) image would be flipped or cropped per channel: refused, with the fix."""
    with pytest.raises(
        ValueError,
        match=r"batch of images \(N, C, H, W\) but got shape \(3, 6, 7\); for one image add "
        r"the batch dimension \(image\[None\]\)",
    ):
        transform(images(n=1)[0])
    with pytest.raises(ValueError, match=r"got shape \(1, 4, 3, 6, 7\); pass images as \(N, C"):
        transform(images()[None])


def test_errors_say_what_was_received_and_what_to_pass() -> None:
    """The argument, the value and its type, and an example of what works."""
    with pytest.raises(TypeError, match=re.escape("dtype=...) must be a torch.dtype")) as e:
        T.RandomResizedCrop(224, dtype="float16")  # type: ignore[arg-type]
    assert "got 'float16', a str" in str(e.value)
    assert "pass e.g. dtype=torch.float16" in str(e.value)
    with pytest.raises(ValueError, match=re.escape("(got p=2.0); pass e.g. p=0.5")):
        T.RandomHorizontalFlip(p=2)
    with pytest.raises(ValueError, match=re.escape("got std=[0.2, 0.0, 0.2]")) as s:
        T.Normalize(MEAN, (0.2, 0.0, 0.2))
    assert "e.g. std=(0.229, 0.224, 0.225)" in str(s.value)


def test_compose_on_one_part_of_the_batch() -> None:
    """Compose(on=KEY) runs the whole pipeline on that part and keeps the rest."""
    batch = {"image": images(), "mask": images(seed=1), "label": torch.arange(4)}
    steps = [T.RandomHorizontalFlip(seed=2), T.Normalize(MEAN, STD)]
    out = T.Compose(steps, on="image")(batch)
    x = batch["image"]
    for step in [T.RandomHorizontalFlip(seed=2), T.Normalize(MEAN, STD)]:
        x = step(x)
    assert torch.equal(out["image"], x)
    assert out["mask"] is batch["mask"]
    assert out["label"] is batch["label"]
    assert "on='image'" in repr(T.Compose(steps, on="image"))
    pair = T.Compose([T.ToDtype(torch.float16)], on=1)((torch.arange(3), images()))
    assert pair[1].dtype == torch.float16
    assert pair[0].dtype == torch.int64


def test_compose_on_keeps_the_state_dict() -> None:
    """on= changes where the pipeline runs, not what a checkpoint holds: states interchange."""
    with_on = T.Compose([T.RandomHorizontalFlip(seed=2), T.ChannelsLast()], on="image")
    with_on({"image": images()})
    without = T.Compose([T.RandomHorizontalFlip(seed=2), T.ChannelsLast()])
    without.load_state_dict(with_on.state_dict())
    assert torch.equal(with_on({"image": images()})["image"], without(images()))


def test_normalize_coefficients_are_kept_per_stream() -> None:
    """On the simulated CUDA: two streams, two uploads, no read across streams without a wait.

    The canary: with one cached copy for every stream, the second stream reads what the
    first wrote, unordered, and the simulation says so.
    """
    for per_stream in (True, False):
        with simulated_cuda() as sim, pytest.MonkeyPatch.context() as m:
            if not per_stream:
                m.setattr(_tensors, "current_stream", lambda device: None)
            x = images().cuda()
            normalize = T.Normalize(MEAN, STD)
            outs = []
            for stream in (torch.cuda.Stream(), torch.cuda.Stream()):  # type: ignore[no-untyped-call]
                stream.wait_stream(torch.cuda.current_stream())  # x was written there
                with torch.cuda.stream(stream):
                    outs.append(normalize(x))
            torch.cuda.synchronize()
            for out in outs:
                torch.testing.assert_close(out.cpu(), T.Normalize(MEAN, STD)(images()))
            if per_stream:
                assert 2 == len(normalize._cache)
                assert [] == sim.hazards
            else:
                assert {Kind.UNORDERED} == sim.kinds()


def test_normalize_cache_is_bounded() -> None:
    """A new copy stream per epoch does not grow the cache without end; evicting is safe."""
    with simulated_cuda() as sim:
        x = images().cuda()
        normalize = T.Normalize(MEAN, STD)
        streams = [torch.cuda.Stream() for _ in range(3 * T.Normalize._CACHED)]  # type: ignore[no-untyped-call]
        for stream in streams + streams[:2]:  # the first two again, after their eviction
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                normalize(x)
            assert len(normalize._cache) <= T.Normalize._CACHED
        torch.cuda.synchronize()
        assert [] == sim.hazards


def test_crop_output_is_always_in_the_range_normalize_expects() -> None:
    """Integer images come out in [0, 1]: Normalize after the crop gives the right values."""
    x = images(n=3, h=12, w=12)
    cropped = T.RandomResizedCrop(12, scale=(1.0, 1.0), ratio=(1.0, 1.0), seed=0)(x)
    assert float(cropped.max()) <= 1.0
    torch.testing.assert_close(cropped, x.float() / 255, atol=1e-6, rtol=0)
    with pytest.raises(TypeError, match="scale_input"):
        T.RandomResizedCrop(12, scale_input=False)  # type: ignore[call-arg]


def test_transform_must_be_callable() -> None:
    """A clear TypeError at construction."""
    with pytest.raises(TypeError, match="transform must be callable"):
        nostall.prefetch([1], transform="normalize")  # type: ignore[arg-type]


@pytest.mark.cuda
def test_cuda_results_equal_cpu_results() -> None:
    """The same transforms on CUDA give the CPU's numbers within float tolerance."""
    x = images(n=8, h=16, w=16)

    def pipeline() -> T.Compose:
        return T.Compose(
            [
                T.RandomResizedCrop(8, seed=2),
                T.RandomHorizontalFlip(seed=3),
                T.Normalize(MEAN, STD),
                T.ChannelsLast(),
            ]
        )

    cpu = pipeline()(x)
    cuda = pipeline()(x.cuda())
    torch.testing.assert_close(cuda.cpu(), cpu, atol=1e-4, rtol=0)


@pytest.mark.cuda
def test_cuda_prefetch_transform_on_the_copy_stream() -> None:
    """Through the prefetcher on CUDA: same numbers as on the CPU, every batch."""
    batches = [images(n=8, seed=i) for i in range(20)]
    expected = [T.Normalize(MEAN, STD)(b) for b in batches]
    got = list(nostall.prefetch(batches, "cuda", transform=T.Normalize(MEAN, STD)))
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g.cpu(), e)


@pytest.mark.cuda
def test_cuda_normalize_allocates_only_its_output() -> None:
    """The fused cast-and-normalise allocates the output and nothing more (after caching).

    128 x 3 x 64 x 64 float32 is 6 MiB, a multiple of the allocator's 2 MiB rounding, so the
    peak is exactly the output when nothing else is allocated; a second full-size buffer would
    double it.
    """
    x = images(n=128, h=64, w=64).cuda()
    normalize = T.Normalize(MEAN, STD)
    normalize(x)  # caches the coefficients
    peak, out = cuda_peak_bytes(lambda: normalize(x))
    output = out.numel() * out.element_size()
    assert peak <= output + (2 << 20), (peak, output)
    assert peak < 2 * output


@pytest.mark.cuda
def test_cuda_crop_allocations_stay_within_the_output() -> None:
    """On the GPU too the crop holds its output plus chunk buffers within half of it."""
    x = images(n=256, h=128, w=128).cuda()
    crop = T.RandomResizedCrop(64)
    # affine_grid is a batched matmul: the first cuBLAS call of a thread on a stream allocates
    # cuBLAS's workspace (32 MiB on an H100) from the caching allocator and keeps it. Whether
    # this test is that first call depends on which tests ran before it in the process.
    crop(x)
    peak, out = cuda_peak_bytes(lambda: crop(x))
    output = out.numel() * out.element_size()  # 12 MiB: whole-batch float input would be 48
    assert peak <= 1.5 * output + (2 << 20), (peak, output)


def test_normalize_cache_is_safe_from_several_threads() -> None:
    """Two prefetchers sharing one Normalize: evictions from several threads never collide.

    The cache's deletes are slowed down so that, without the lock, two threads pick the same
    oldest entry and the second delete fails.
    """
    import threading
    import time

    class SlowDeletes(dict):  # type: ignore[type-arg]
        def __delitem__(self, key: Any) -> None:
            time.sleep(0.002)  # another thread runs here
            super().__delitem__(key)

    norm = T.Normalize(MEAN, STD)
    norm._cache = SlowDeletes()
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def hammer(k: int) -> None:
        start.wait()
        try:
            for i in range(30):
                norm._coefficients(torch.zeros(1, 3, 1, 1), float(4 * i + k + 1), torch.float32)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=hammer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert [] == errors
    assert len(norm._cache) <= T.Normalize._CACHED
