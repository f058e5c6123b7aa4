"""The CLI's progress bar and tables (cudnn_fuse.progress), on a terminal and off one."""

from __future__ import annotations

import io

from cudnn_fuse.progress import Bar, format_table, human_bytes


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_the_bar_redraws_one_line_with_counts_percent_and_eta():
    out = _Terminal()
    bar = Bar("tuning conv2d", stream=out)
    for done in range(5):
        bar(done, 4)
    text = out.getvalue()
    assert text.count("\r") == 5 and text.count("\n") == 1 and text.endswith("\n")
    assert "0/4" in text and "2/4  50%" in text and "4/4 100%" in text and "eta" in text
    assert "[" + "#" * 30 + "]" in text


def test_off_a_terminal_the_bar_writes_a_few_plain_lines():
    """A log or a pipe gets one line at the start, one per quarter and one at the end, never a
    carriage return, however many steps there are."""
    out = io.StringIO()
    bar = Bar("prewarm plans.json", stream=out)
    for done in range(101):
        bar(done, 100)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and out.getvalue().endswith("\n")
    assert [ln.split(": ")[1].split()[0] for ln in lines] == ["0/100", "25/100", "50/100", "75/100", "100/100"]
    assert all(ln.startswith("prewarm plans.json: ") and "eta" in ln for ln in lines)


def test_a_bar_with_nothing_to_do_is_done():
    for out in (io.StringIO(), _Terminal()):
        Bar("prewarm", stream=out)(0, 0)
        assert "0/0 100%" in out.getvalue() and out.getvalue().endswith("\n")


def test_a_sub_bar_keeps_the_stream_and_names_its_part():
    out = io.StringIO()
    inner = Bar("tuning conv2d", stream=out).sub("as a GEMM")
    inner(1, 1)
    assert out.getvalue().startswith("tuning conv2d (as a GEMM): 1/1 100%")


def test_format_table_aligns_columns():
    rows = [("conv2d", 0.09, "cpu"), ("scaled_dot_product_attention", 1, "cuda")]
    assert format_table(("op", "ms", "device"), rows).splitlines() == [
        "op                            ms    device",
        "----------------------------  ----  ------",
        "conv2d                        0.09  cpu",
        "scaled_dot_product_attention  1     cuda",
    ]


def test_human_bytes():
    assert [human_bytes(n) for n in (0, 1023, 1536, 5 * 2**30)] == ["0 B", "1023 B", "1.5 KiB", "5.0 GiB"]
