"""The alpha-beta model behind ``turbotrain comm-plan``: formulas, fitting, NCCL picks, output."""

from __future__ import annotations

import json
import math

import pytest

from turbotrain.comm.model import (DEFAULT_RANKS, LINKS, Fit, Topology, all_gather, all_to_all, collective_time,
                                   fit_alpha_beta, format_table, hierarchical_allreduce, link_from_fit,
                                   load_bench_rows, nccl_settings, parameter_server, predict, ring_allreduce,
                                   run_comm_plan, transformer_width, tree_allreduce)
from turbotrain.comm.nccl import validate_nccl_env
from turbotrain.errors import ConfigError

GB = 1e9
IB, ETH, NVL = LINKS["400ib"], LINKS["100gbe"], LINKS["nvlink"]


def test_ring_is_2_n_minus_1_steps_and_2_n_minus_1_over_n_of_the_buffer():
    one_node = Topology(1, 8, ETH)
    s = 1e9
    assert ring_allreduce(s, one_node) == pytest.approx(14 * NVL.alpha_s + 2 * 7 / 8 * s / NVL.bytes_per_s)
    # across nodes every step waits for the network hop, and one ring edge per node crosses the NIC
    multi = Topology(4, 8, ETH)
    assert ring_allreduce(s, multi) == pytest.approx(62 * ETH.alpha_s + 2 * 31 / 32 * s / ETH.bytes_per_s)
    assert ring_allreduce(s, Topology(1, 1, ETH)) == 0.0


def test_tree_wins_on_latency_and_ring_on_bandwidth():
    big = Topology(128, 8, IB, nics_per_node=8)
    assert tree_allreduce(64e3, big) < ring_allreduce(64e3, big) / 10  # 2 log2 M steps, not 2(N-1)
    small = Topology(1, 8, IB)
    assert ring_allreduce(4e9, small) < tree_allreduce(4e9, small)  # 2(N-1)/N < 2 bytes per byte


def test_hierarchical_cuts_the_networks_latency_steps_and_halves_its_bytes_on_two_nodes():
    two = Topology(2, 8, ETH)
    s = 1e9
    network_only = 2 * ETH.alpha_s + 1.0 * s / ETH.bytes_per_s  # 2(M-1)/M = 1 for M = 2
    inside = 2 * (7 * NVL.alpha_s + 7 / 8 * s / NVL.bytes_per_s)
    assert hierarchical_allreduce(s, two) == pytest.approx(network_only + inside)
    assert hierarchical_allreduce(s, two) < 0.6 * ring_allreduce(s, two)


def test_parameter_server_is_bound_by_the_servers_links():
    topo = Topology(16, 8, ETH)
    s = 1e9
    one, four = parameter_server(s, topo, 1), parameter_server(s, topo, 4)
    assert one == pytest.approx(2 * (ETH.alpha_s + 120 * s / ETH.bytes_per_s))  # 120 off-node workers push to it
    assert four == pytest.approx(2 * (ETH.alpha_s + 30 * s / ETH.bytes_per_s))
    assert one > 30 * ring_allreduce(s, topo)
    with pytest.raises(ConfigError, match="choose from ring, tree, hierarchical, parameter_server"):
        collective_time("butterfly", s, topo)


def test_all_to_all_concentrates_a_nodes_traffic_on_its_nics():
    topo = Topology(16, 8, ETH)
    s = 1e8
    assert all_to_all(s, topo) == pytest.approx(127 * ETH.alpha_s + 8 * 120 / 128 * s / ETH.bytes_per_s)
    assert all_gather(s, topo) == pytest.approx(127 * ETH.alpha_s + 127 / 128 * s / ETH.bytes_per_s)


def _rows(alpha, beta, world=2, op="all_reduce", noise=()):
    sizes = [2**k for k in range(10, 25, 2)]
    rows = []
    for i, size in enumerate(sizes):
        t = (alpha + beta * size) * (1 + (noise[i % len(noise)] if noise else 0))
        rows.append({"workload": "comm-bench", "config": {"op": op, "size": size, "count": size // 4, "type": "float32",
                     "redop": "sum", "backend": "gloo", "world_size": world}, "time_us": t * 1e6})
    return rows


def test_fit_recovers_alpha_and_beta_and_states_its_error(tmp_path):
    exact = fit_alpha_beta(_rows(30e-6, 1 / 2e9))[("all_reduce", 2)]
    assert exact.alpha_s == pytest.approx(30e-6, rel=1e-6) and exact.beta_s_per_byte == pytest.approx(5e-10, rel=1e-6)
    assert exact.max_error < 1e-9
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(_rows(30e-6, 1 / 2e9, noise=(0.05, -0.05, 0.02))))
    noisy = fit_alpha_beta(str(path))[("all_reduce", 2)]
    assert noisy.alpha_s == pytest.approx(30e-6, rel=0.1) and noisy.beta_s_per_byte == pytest.approx(5e-10, rel=0.1)
    assert 0.01 < noisy.max_error < 0.1 and "error vs measured median" in noisy.describe()


def test_fit_reads_flat_rows_and_refuses_others():
    flat = [{"op": "all_gather", "size": 1 << k, "time_us": 10 + (1 << k) / 1e3, "world_size": 4} for k in (12, 16, 20)]
    fit = fit_alpha_beta(flat)[("all_gather", 4)]
    assert fit.alpha_s == pytest.approx(10e-6, rel=1e-6)
    with pytest.raises(ConfigError, match="not a comm-bench row"):
        load_bench_rows([{"op": "all_reduce", "size": 4}])


def test_rows_come_from_a_path_or_json_text_and_bad_files_are_named(tmp_path):
    rows = [{"op": "all_gather", "size": 4096, "time_us": 12.0, "world_size": 2}]
    path = tmp_path / "[rows].json"  # a file name that starts like JSON text: passed as a Path, read as a file
    path.write_text(json.dumps(rows))
    expected = [("all_gather", 2, 4096, pytest.approx(12e-6))]
    assert load_bench_rows(path) == load_bench_rows(str(path)) == load_bench_rows(json.dumps(rows)) == expected
    with pytest.raises(ConfigError, match="cannot read the comm-bench rows .*missing.json"):
        load_bench_rows(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json is not JSON"):
        load_bench_rows(tmp_path / "bad.json")
    (tmp_path / "dict.json").write_text(json.dumps({"rows": rows}))
    with pytest.raises(ConfigError, match="a JSON list, got dict"):
        load_bench_rows(tmp_path / "dict.json")


def test_a_fit_turns_into_a_per_hop_link():
    fit = Fit("all_reduce", 2, alpha_s=60e-6, beta_s_per_byte=1 / 1e9, points=5, median_error=0.0, max_error=0.0)
    link = link_from_fit(fit, ETH)
    assert link.alpha_s == pytest.approx(30e-6)  # 2(n-1) = 2 steps
    assert link.bytes_per_s == pytest.approx(1e9)  # 2(n-1)/n = 1 byte per byte of buffer at n = 2
    assert ring_allreduce(1e6, Topology(1, 2, link, intra=link)) == pytest.approx(fit.time(1e6))


def test_predict_covers_every_algorithm_and_compressor_for_every_rank_count():
    rows = predict(7e9, "100gbe", nodes=16, gpus_per_node=8, compute_s=1.0)
    assert sorted({r["ranks"] for r in rows}) == list(DEFAULT_RANKS)
    for n in DEFAULT_RANKS:
        mine = {(r["algorithm"], r["compressor"]) for r in rows if r["ranks"] == n}
        assert len(mine) == 12
        assert {c for _, c in mine} == {"none", "bf16", "powersgd r=4", "onebit"}
        assert {a for a, _ in mine} >= {"ring", "tree", "hierarchical", "parameter_server"}
    job = {(r["algorithm"], r["compressor"]): r for r in rows if r["ranks"] == 128}
    ring = job[("ring", "none")]
    assert ring["bytes_per_rank"] == 28e9 and ring["step_s"] == pytest.approx(1.0 + ring["exposed_s"])
    assert ring["exposed_s"] == pytest.approx(ring["comm_s"] - 2 / 3)  # backward hides 2/3 of compute
    assert job[("ring", "bf16")]["comm_s"] < ring["comm_s"] / 1.9
    assert job[("all_to_all+all_gather", "onebit")]["exposed_s"] == job[("all_to_all+all_gather", "onebit")]["comm_s"]
    assert job[("ring", "powersgd r=4")]["bytes_per_rank"] < ring["bytes_per_rank"] / 500
    assert 3500 < transformer_width(7e9) < 4500


def test_nccl_settings_are_valid_and_follow_the_link():
    for topo in (Topology(16, 8, ETH), Topology(2, 8, LINKS["10gbe"]), Topology(128, 8, IB, nics_per_node=8),
                 Topology(1, 8, IB)):
        picked = nccl_settings(topo)
        validate_nccl_env({k: v for k, v, _ in picked})
        assert all(reason for _, _, reason in picked)
    eth = dict((k, v) for k, v, _ in nccl_settings(Topology(16, 8, ETH)))
    assert int(eth["NCCL_SOCKET_NTHREADS"]) * int(eth["NCCL_NSOCKS_PERTHREAD"]) == 8  # 100 / 12.5 Gbit/s per stream
    assert "NCCL_SOCKET_NTHREADS" not in dict((k, v) for k, v, _ in nccl_settings(Topology(16, 8, IB)))
    assert dict((k, v) for k, v, _ in nccl_settings(Topology(128, 8, IB, nics_per_node=8)))["NCCL_ALGO"] == "Tree"
    assert dict((k, v) for k, v, _ in nccl_settings(Topology(1, 8, IB)))["NCCL_ALGO"] == "Ring"


def test_run_comm_plan_prints_tables_settings_and_writes_a_plot(tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(_rows(40e-6, 1 / 1.2e9)))
    text = run_comm_plan(7e9, "100gbe", 16, fit_json=str(bench), plot=str(tmp_path / "plan.png"))
    for part in ("## this job: N = 128", "## comm overhead", "NCCL_ALGO=", "# fit: all_reduce on 2 ranks",
                 "compute per step not given"):
        assert part in text
    assert (tmp_path / "plan.png").stat().st_size > 1000
    assert "powersgd r=4" in format_table(predict(1e8, "nvlink", 1, compute_s=0.1, ranks=()))
    with pytest.raises(ConfigError, match="choose from 10gbe, 25gbe, 100gbe, 200ib, 400ib, nvlink"):
        run_comm_plan(7e9, "token-ring", 2)


def test_model_does_not_import_matplotlib_until_asked():
    import subprocess
    import sys

    code = "import sys, turbotrain.comm.model as m; m.predict(1e8, '10gbe', 2); print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_inputs_are_checked():
    with pytest.raises(ConfigError, match="model_params > 0"):
        predict(0, "10gbe", 1)
    assert math.isfinite(predict(1e6, "ib400", 1, gpus_per_node=1, compute_s=1.0, ranks=())[0]["step_s"])


def test_comm_plan_cli_takes_the_fit_flag_the_docs_name(tmp_path, capsys):
    """docs/comm-plan.md and the README say --fit-json; --fit is kept for scripts that used it."""
    from turbotrain.cli import main

    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(_rows(40e-6, 1 / 1.2e9)))
    for flag in ("--fit-json", "--fit"):
        assert main(["comm-plan", "--model-params", "1e8", "--link", "10gbe", "--nodes", "2", flag, str(bench)]) == 0
        assert "# fit: all_reduce on 2 ranks" in capsys.readouterr().out
