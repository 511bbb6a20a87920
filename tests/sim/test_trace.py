"""Trace files: the common format, the Azure header, windows and scales, and the errors a user sees."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipeline.core.sim.generation.trace import TraceError, TraceSlice, read_trace, trace_arrivals, write_trace


def azure(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "azure.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(lines) + "\n")
    return path


def test_the_azure_header_reads_date_times_as_offsets_from_the_first_request(tmp_path: Path) -> None:
    path = azure(
        tmp_path,
        ["2023-11-16 18:17:03.9799600,4808,10", "2023-11-16 18:17:04.0319600,3180,8", "2023-11-16 18:17:05.5,110,27"],
    )
    trace = read_trace(path)
    assert trace.offset_ms == pytest.approx([0.0, 52.0, 1520.04])
    assert trace.prompt.tolist() == [4808, 3180, 110]
    assert trace.answer.tolist() == [10, 8, 27]
    assert trace.index.tolist() == [0, 1, 2]


def test_the_common_format_takes_seconds_in_any_column_order_and_sorts_by_time(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("answer_tokens,timestamp,prompt_tokens,ignored\n5,10.5,100,x\n7,10.0,200,y\n\n9,12,300,z\n")
    trace = read_trace(path)
    assert trace.index.tolist() == [1, 0, 2]  # the file's rows, kept through the sort
    assert trace.offset_ms.tolist() == pytest.approx([0.0, 500.0, 2000.0])
    assert trace.prompt.tolist() == [200, 100, 300]
    assert trace.answer.tolist() == [7, 5, 9]


def test_a_slice_is_a_window_of_trace_time_stretched_and_shortened(tmp_path: Path) -> None:
    offsets = np.arange(10, dtype=float)  # one request a second
    path = write_trace(tmp_path / "t.csv", offsets, np.arange(10) * 100 + 1, np.full(10, 3))
    part = TraceSlice(time_scale=4.0, length_scale=0.5, start_s=2.5, duration_s=4.0).apply(read_trace(path))
    assert part.index.tolist() == [3, 4, 5, 6]
    assert part.offset_ms.tolist() == pytest.approx([2000.0, 6000.0, 10000.0, 14000.0])  # from the window start, x4
    assert part.prompt.tolist() == [150, 200, 250, 300]
    assert part.answer.tolist() == [2, 2, 2, 2]
    assert part.rate_per_s == pytest.approx(0.25)
    kept = TraceSlice(length_scale=0.5, answer_scale=2.0).apply(read_trace(path))
    assert kept.prompt[3] == 150 and kept.answer.tolist() == [6] * 10  # answers by their own scale
    tiny = TraceSlice(length_scale=0.01).apply(read_trace(path))
    assert tiny.prompt.min() == 1 and tiny.answer.min() == 1  # a request keeps a token


def test_trace_arrivals_ask_for_exactly_the_answer(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.csv", np.array([0.0, 0.25]), np.array([30, 40]), np.array([5, 9]))
    arr = trace_arrivals(TraceSlice().apply(read_trace(path)))
    assert arr.create_ms.tolist() == [0.0, 250.0]
    assert arr.emits.tolist() == arr.limit.tolist() == [5, 9]
    assert arr.prompt.tolist() == [30, 40]
    assert np.isnan(arr.deadline_ms).all()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty file"),
        ("time,in,out\n1,2,3\n", "unknown header 'time,in,out'"),
        ("timestamp,prompt_tokens,answer_tokens\n", "no requests after the header"),
        ("timestamp,prompt_tokens,answer_tokens\n0,10,5\n1,10\n", "line 3: 2 columns"),
        ("timestamp,prompt_tokens,answer_tokens\nyesterday,10,5\n", "line 2: timestamp 'yesterday'"),
        ("timestamp,prompt_tokens,answer_tokens\n0,ten,5\n", "line 2: prompt tokens 'ten' is not a whole number"),
        ("timestamp,prompt_tokens,answer_tokens\n0,10,-5\n", "line 2: answer tokens -5 is negative"),
        ("timestamp,prompt_tokens,answer_tokens\nnan,10,5\n", "line 2: timestamp 'nan' is not a finite time"),
    ],
)
def test_a_bad_file_is_refused_with_the_line_and_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(TraceError, match=message) as caught:
        read_trace(path)
    assert str(path) in str(caught.value)


def test_missing_files_and_empty_windows_and_bad_scales_say_so(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read the trace"):
        read_trace(tmp_path / "nope.csv")
    path = write_trace(tmp_path / "t.csv", np.array([0.0, 1.0]), np.array([3, 4]), np.array([1, 2]))
    with pytest.raises(TraceError, match=r"no request in window 5 s to 6 s .* spans 1.0 s"):
        TraceSlice(start_s=5, duration_s=1).apply(read_trace(path))
    for bad in (
        {"time_scale": 0.0},
        {"length_scale": -1.0},
        {"start_s": -1.0},
        {"duration_s": 0.0},
        {"answer_scale": 0.0},
    ):
        with pytest.raises(TraceError):
            TraceSlice(**bad)
