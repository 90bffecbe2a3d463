"""Rendering of recorded runs (:mod:`oscar_cli.bench.render`) over a recorded, synthetic sample: the summary and
profile tables, the RESULTS.md section, the notes and the plot."""

from __future__ import annotations

import pytest
from bench_kit import SAMPLE

from oscar_cli.bench.records import load_records
from oscar_cli.bench.render import (
    SUMMARY_HEADERS,
    append_results,
    notes,
    plot,
    plot_series,
    results_section,
    summary_rows,
)


def test_summary_rows_put_the_numbers_in_their_cells():
    records = load_records(SAMPLE)
    rows = {r[0]: dict(zip(SUMMARY_HEADERS[:8], r[:8], strict=True)) | {"rest": r[8:]}
            for r in summary_rows(records)}
    assert list(rows) == ["flashinfer", "flashinfer-fp8", "oscar"]
    o, f8, bf = rows["oscar"], rows["flashinfer-fp8"], rows["flashinfer"]
    assert (bf["max tokens"], bf["x BF16"], bf["req @100k"], bf["bits/el"], bf["bits/el pool"]) == \
        ("700,000", "1.00x", "7", "16.00", "16.00")
    assert (f8["x BF16"], f8["req @100k"], f8["bits/el"], f8["bits/el pool"], f8["admitted"]) == \
        ("2.00x", "14", "8.00", "8.00", "14/14 @32k")
    assert o["max tokens"] == "4,500,000" and o["x BF16"] == f"{4_500_000 / 700_000:.2f}x" == "6.43x"
    assert o["req @100k"] == "45" and o["admitted"] == "45/45 @32k"  # the larger of /v1/loads (44) and the log (45)
    assert o["bits/el"] == f"{8 * 20736 / 73728:.2f}" == "2.25"  # the plugin's cell bytes over 36 x 2 x 8 x 128
    assert o["bits/el pool"] == f"{8 * 93.0 * 2**30 / (4_500_000 * 73728):.2f}" == "2.41"  # SGLang's kvcache GiB
    large, x_large, x_fp8, equal, x_equal, itl8, itl32, itl100, ttft, x_ttft, peak = o["rest"]
    assert (large, x_large, equal, x_equal) == ("2,000 (bs45 R)", "4.00x", "800 (bs7 R)", "1.60x")
    assert x_fp8 == f"{2000 / 900:.2f}x"  # against flashinfer-fp8's largest batch (900 tok/s at bs14)
    assert (itl8, itl32, itl100, ttft, x_ttft) == ("8.00", "8.30", "—", "—", "—")  # the 100k latency failed
    assert peak == f"{127000 / 1024:.1f}"
    assert rows["flashinfer-fp8"]["rest"][8:10] == ["5.0", "1.00x"]  # time to first token of the 100k prompt
    assert rows["flashinfer-fp8"]["rest"][:5] == ["900 (bs14 R)", "1.80x", "1.00x", "520 (bs7 R)", "1.04x"]
    assert rows["flashinfer"]["rest"][2] == f"{500 / 900:.2f}x"


def test_equal_batch_ratio_needs_the_same_batch():
    records = [r for r in load_records(SAMPLE) if not (r["config"] == "flashinfer" and r["measure"] == "throughput")]
    records.append({**next(r for r in load_records(SAMPLE) if r["measure"] == "throughput"), "batch": 8,
                    "roles": ["largest", "equal"]})
    o = next(r for r in summary_rows(records) if r[0] == "oscar")
    assert o[11] == "800 (bs7 R)" and o[12] == "—"  # BF16 ran bs8, not bs7: no ratio at equal batch
    assert o[9] == "4.00x"  # the largest-batch ratio does not need equal batches


def test_throughput_ratios_need_the_same_cache_fill():
    """A distinct-pages run is never set against a shared-prefix baseline (BF16 pages served from L2): the ratios
    take the baseline's record with the same fill and context, or show none."""
    records = load_records(SAMPLE)
    tp = [r for r in records if r["measure"] == "throughput" and r["config"] == "oscar"]
    records += [{**r, "fill": "null", "tok_s": r["tok_s"] / 2} for r in tp]  # oscar again, on distinct pages
    o = next(r for r in summary_rows(records) if r[0] == "oscar")
    assert o[8].endswith(" N)") and o[9:11] == ["—", "—"] and o[12] == "—"
    base = [r for r in records if r["measure"] == "throughput" and r["config"] == "flashinfer"]
    records += [{**r, "fill": "null", "tok_s": 250.0} for r in base]
    o = next(r for r in summary_rows(records) if r[0] == "oscar")
    assert o[9] == "4.00x" and o[10] == "—" and o[12] == "1.60x"  # 1000 / 250, 400 / 250; no FP8 on distinct pages


def test_results_section_and_profile_rows(tmp_path):
    records = load_records(SAMPLE)
    text = results_section(records)
    title = text.splitlines()[0]
    assert title.startswith("## oscar bench, SGLang 0.5.17") and "2026-12-02" in title and "NVIDIA H200" in title
    assert "commit 0.1.0+gsample" in title and "SYNTHETIC SAMPLE, not measured" in title
    assert "Command: `oscar bench --configs flashinfer,flashinfer-fp8,oscar --profile (synthetic sample)`" in text
    assert ("| oscar | INT2 g128 s64/r256 | 4,500,000 | 6.43x | 45 | 45/45 @32k | 2.25 | 2.41 | 2,000 (bs45 R) | "
            "4.00x | 2.22x | 800 (bs7 R) | 1.60x | 8.00 | 8.30 | — | — | — | 124.0 |") in text
    assert "| oscar | bs45/100k | 30.00 | 9.00 | 3.00 | 42.00 | 71% |" in text
    assert "| flashinfer | bs1/100k | 2.50 | 6.00 | 0.90 | 9.40 | 27% |" in text
    assert "* oscar latency at 100000: error: RuntimeError: the server is not running" in text
    assert "* flashinfer-fp8 profile: skipped:" in text
    md = tmp_path / "R.md"
    md.write_text("# Results\n")
    append_results(md, text)
    assert md.read_text() == "# Results\n\n" + text


def test_notes_leave_out_what_a_later_record_made_good():
    base = dict(config="oscar", measure="throughput", batch=50, context=100000)
    lat = dict(base, measure="latency", batch=None)
    records = [dict(base, skipped="time budget spent"), dict(base, tok_s=1046.0), dict(lat, itl_ms=9.4),
               dict(lat, context=None, skipped="time budget spent"), dict(lat, context=8192, error="boom")]
    assert notes(records) == ["oscar latency at 8192: error: boom"]  # the bs50 rate and a 100k latency exist


def test_plot_series_and_file(tmp_path):
    records = load_records(SAMPLE)
    s = plot_series(records)
    assert s["tok_s_batch"]["oscar"] == [(7, 800.0), (45, 2000.0)]
    assert s["tok_s_batch"]["flashinfer"] == [(7, 500.0)]
    assert s["tok_s_context"]["flashinfer"] == [(c, pytest.approx(1e3 / itl)) for c, itl in
                                                ((8192, 7.1), (32768, 7.9), (100000, 9.4))]
    assert [x for x, _ in s["tok_s_context"]["oscar"]] == [8192, 32768]  # the failed 100k point is not drawn
    per_token = 93.0 / 4_500_000  # GiB per token slot of oscar's pool
    assert s["mem_batch"]["oscar KV in use"] == [(7, pytest.approx(100800 * per_token)),
                                                 (45, pytest.approx(107000 * per_token))]
    assert s["mem_batch"]["oscar device peak"] == [(7, 124000 / 1024), (45, 127000 / 1024)]
    out = plot(records, tmp_path / "p.png")
    assert out == s and (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
