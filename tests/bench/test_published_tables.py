"""The published tables of docs/results.md are what bench/published_tables.py generates from the
stored runs in bench/results/: a figure typed by hand, or a cache changed without regenerating
the page, fails here."""

import json
import math

import pytest

from bench.published_tables import (
    PAGE,
    PAGES,
    README,
    TABLES,
    render,
    s1_shift_table,
    s1_verdict_table,
)


def test_every_table_block_of_the_results_page_equals_its_generation_from_the_caches():
    texts = {page.name: page.read_text(encoding="utf-8") for page in PAGES}
    assert {PAGE, README} <= set(PAGES)
    for name in TABLES:
        assert any(f"<!-- table:{name} -->" in t for t in texts.values()), f"no {name} block"
    for where, text in texts.items():
        assert render(text) == text, (f"{where} differs from the caches: run "
                                      "`python bench/published_tables.py --write`")


def record(label, seed, nll30, auroc, plugin=True):
    shift = {"predictive/clean": {"accuracy": 0.9, "nll": 0.2, "ece": 0.01, "brier": 0.1},
             "predictive/30": {"accuracy": 0.7, "nll": nll30, "ece": 0.1, "brier": 0.4},
             "predictive/60": {"accuracy": 0.4, "nll": 2 * nll30, "ece": 0.2, "brier": 0.8},
             "predictive/auroc_entropy": auroc}
    if plugin:
        shift |= {f"map_plugin/{k[len('predictive/'):]}": v for k, v in shift.items()}
    return json.loads(json.dumps({"label": label, "seed": seed, "rounds": 30, "shift": shift}))


def test_the_shift_table_gives_mean_and_standard_error_over_seeds():
    table = s1_shift_table([record("A", 0, 1.0, 0.8), record("A", 1, 3.0, 0.9)])
    row = next(line for line in table.splitlines() if line.startswith("| A | headline"))
    assert "| 0,1 |" in row and "2.000 ± 1.000" in row and "0.850 ± 0.050" in row


def test_a_verdict_says_does_not_hold_where_the_other_method_is_better():
    from bench.published_tables import RECOMMENDED

    records = [record(RECOMMENDED, 0, 1.0, 0.80), record("FedPer", 0, 2.0, 0.90, plugin=False)]
    lines = s1_verdict_table(records).splitlines()
    nll = next(line for line in lines if "FedPer" in line and "NLL at 30°" in line)
    auroc = next(line for line in lines if "FedPer" in line and "AUROC" in line)
    assert nll.endswith("| holds |") and auroc.endswith("| does not hold |")


# --- issue 43: the tables that were typed by hand -------------------------------------------

PROVENANCE = {"commit": "abc1234", "date": "2026-11-28",
              "machine": "CPU Test (AVX2), 1 torch thread(s)"}


def test_a_paired_verdict_holds_fails_or_is_unresolved_by_one_standard_error():
    from bench.published_tables import verdict

    # differences 1, 2, 3: mean 2, standard error 1/sqrt(3) = 0.577 (stdev 1)
    assert verdict([1.0, 2.0, 3.0]) == "holds"
    assert verdict([1.0, 2.0, 3.0], direction=-1) == "does not hold"
    # mean 0.1, standard error 0.9/sqrt(2)·... > 0.1: not resolved either way
    assert verdict([1.0, -0.8]).startswith("not resolved")
    assert verdict([-0.5]) == "does not hold"  # one seed: its sign


def test_the_paired_cell_is_the_mean_and_standard_error_of_the_differences():
    import numpy as np

    from bench.published_tables import paired_cell

    diffs = [0.012, -0.003, 0.021, 0.007]
    expected_se = np.std(diffs, ddof=1) / np.sqrt(len(diffs))  # numpy as the reference
    assert paired_cell(diffs, 100, 3) == f"{100 * np.mean(diffs):+.3f} ± {100 * expected_se:.3f}"


def test_a_source_line_names_machine_date_commit_and_seeds_or_a_legacy_origin():
    from bench.published_tables import LEGACY_ORIGIN, source_line

    line = source_line("x.jsonl", [PROVENANCE, PROVENANCE | {"commit": "def5678"}], [1, 0, 1])
    assert "CPU Test (AVX2)" in line and "2026-11-28" in line
    assert "abc1234, def5678" in line and "seeds 0,1" in line and "2 runs" in line
    assert LEGACY_ORIGIN["fedpart.jsonl"] in source_line("fedpart.jsonl", [{"seed": 0}])
    moving = [PROVENANCE | {"commit": c} for c in ("c1", "c2", "c2", "c3", "c4")]
    assert "4 commits, c1 (first run) to c4 (last)" in source_line("x.jsonl", moving)


def fedlog_record(label, seed, accuracy, nll, plugin_nll, bytes_up):
    return {"label": label, "seed": seed, "rounds": 30, "accuracy": accuracy, "ece": 0.01,
            "nll": nll, "bytes_up": bytes_up, "bytes_down": bytes_up,
            "map_plugin": {"accuracy": accuracy, "ece": 0.01, "nll": plugin_nll}, **PROVENANCE}


def test_fedlog_checks_pair_by_seed_and_say_when_the_predictive_does_not_beat_its_plug_in():
    from bench.published_tables import fedlog_checks_table, fedlog_vs_fedavg_table

    records = [fedlog_record("fedlog", s, 0.99, 0.10 + 0.01 * s, 0.09 + 0.01 * s, 1e6)
               for s in range(3)]
    records += [fedlog_record("fedavg", s, 0.75 + 0.01 * s, 0.7, 0.7, 50e6) for s in range(3)]
    lines = fedlog_checks_table(records).splitlines()
    gain = next(line for line in lines if "more accurate than FedAvg" in line)
    assert "+23.00 ± 0.58 points" in gain and gain.endswith("| holds |")
    nll = next(line for line in lines if "NLL is below its plug-in's" in line)
    assert "+0.01000" in nll and nll.endswith("| does not hold |")
    assert next(line for line in lines if "3%" in line).endswith("| holds |")  # 2% of FedAvg's
    table = fedlog_vs_fedavg_table(records)
    assert "| FedLog (s = 1) | MAP plug-in |" in table and "commit abc1234" in table


def dp_record(placement, epsilon, seed, accuracy, noise_to_signal, warned, ece, face_ece):
    strategy = {"local": "fedlog-dp-local", "central": "fedlog-dp-central"}.get(placement,
                                                                              "fedlog")
    record = {"strategy": strategy, "placement": placement, "epsilon": epsilon, "seed": seed,
              "rounds": 30, "accuracy": accuracy, "ece": ece, "nll": 10 * ece, **PROVENANCE}
    if epsilon is not None:
        record |= {"face_ece": face_ece, "face_nll": 10 * face_ece, "sigma": 10.0,
                   "noise_to_signal": noise_to_signal, "warned": float(warned)}
    return record


def test_dp_checks_find_the_smallest_epsilon_within_a_point_and_the_warning_rule():
    from bench.published_tables import dp_checks_table, dp_price_table

    records = []
    for seed in range(2):
        records.append(dp_record("none", None, seed, 0.99, 0, False, 0.01, 0))
        records.append(dp_record("central", 2.0, seed, 0.50, 0.9, True, 0.2, 0.6))
        records.append(dp_record("central", 4.0, seed, 0.985, 0.4, False, 0.02, 0.02))
        records.append(dp_record("central", 8.0, seed, 0.99, 0.2, False, 0.01, 0.01))
        records.append(dp_record("local", 16.0, seed, 0.97, 0.6, seed == 0, 0.1, 0.3))
    lines = dp_checks_table(records).splitlines()
    central = next(line for line in lines if "central DP: smallest ε" in line)
    assert "ε = 4 (-0.50 points)" in central  # 2 is 49 points short; 4 is within one
    assert "no ε run reaches it" in next(line for line in lines if "local DP: smallest" in line)
    warning = next(line for line in lines if "the warning fires" in line)
    assert "7 of 8 runs" in warning and warning.endswith("| does not hold |")  # local seed 1
    ece = next(line for line in lines if "ECE is below the face-value" in line)
    assert ece.endswith("| holds |")
    table = dp_price_table(records)
    assert "| central | 2 | 10.0 | 0.90 ± 0.00 | 2/2 | 0.500 ± 0.000 |" in table
    # a seed an interrupted bench left half done is in no row
    table = dp_price_table([*records, dp_record("none", None, 2, 0.5, 0, False, 0.01, 0)])
    assert "(10 runs, seeds 0,1)" in table and "0.990 ± 0.000" in table


def test_fedpart_verdicts_pair_by_seed_against_full_network_updates():
    from bench.published_tables import fedpart_table

    def run(method, seed, best, total_bytes, flops, seconds):
        return {"method": method, "partition": "iid", "seed": seed, "best": best,
                "final": best, "total_bytes": total_bytes, "total_flops": flops,
                "total_seconds": seconds, **PROVENANCE}

    records = [run("FNU", s, 0.96, 10e6, 1e12, 10.0) for s in range(2)]
    records += [run("FedPart", s, 0.95 - 0.01 * s, 2.5e6, 0.6e12, 8.0) for s in range(2)]
    lines = fedpart_table(records, name="test.jsonl").splitlines()
    assert next(line for line in lines if "upload" in line).endswith("| 25.0% | holds |")
    compute = next(line for line in lines if "compute" in line)
    assert "60.0% of the FLOPs, 80.0% of the measured CPU s" in compute
    assert compute.endswith("| does not hold |")  # the CPU time is above 73%
    accuracy = next(line for line in lines if "equal to or above" in line)
    assert "-1.50 ± 0.50 points (2 seeds)" in accuracy and accuracy.endswith("does not hold |")


def test_colearn_table_reads_the_cache_keys_and_pairs_colearn_with_each_peer():
    from bench.published_tables import colearn_table

    def run(accuracy):
        return {"accuracy": accuracy, "ece": 0.1, "nll": 0.5,
                "bytes_up_per_client_round": 7280.0, **PROVENANCE}

    cache = {}
    for seed, (ours, il, fl) in enumerate([(0.90, 0.85, 0.95), (0.92, 0.86, 0.91)]):
        cache[f"rows|colearn|10|{seed}|10|relay=sets"] = run(ours)
        cache[f"rows|il|10|{seed}|10|relay=sets"] = run(il)
        cache[f"rows|fl|10|{seed}|10|relay=sets"] = run(fl)
        cache[f"rows|colearn|10|{seed}|100|relay=sets"] = run(0.0)  # another protocol: ignored
    table = colearn_table(cache)
    assert "| CoLearn | 2 | 91.00 ± 1.00 (82.07) |" in table
    il = next(line for line in table.splitlines() if "beats IL" in line)
    assert "+5.50 ± 0.50" in il and il.endswith("| holds |")
    fl = next(line for line in table.splitlines() if "beats FL" in line)
    assert "-2.00 ± 3.00" in fl and "not resolved" in fl
    assert "(6 runs, seeds 0,1)" in table


def test_the_readme_s1_table_puts_the_plug_in_under_every_posterior_method_only():
    from bench.published_tables import s1_h200_readme_table

    def run(label, seed, plugin):
        summary = {"accuracy": 0.9, "ece": 0.02, "nll": 0.3, "brier": 0.1, "bytes_up": 1e6}
        if plugin:
            summary["map_plugin"] = {"accuracy": 0.9, "ece": 0.04, "nll": 0.4, "brier": 0.12}
        return {"label": label, "seed": seed, "rounds": 30, "novel": False, "summary": summary}

    table = s1_h200_readme_table([run("FedPop", 0, True), run("FedPop", 1, True),
                                  run("FedAvg", 0, False), run("FedAvg", 0, False) | {
                                      "rounds": 5}])
    rows = [line for line in table.splitlines() if line.startswith("| Fed")]
    assert [r.split(" | ")[:2] for r in rows] == [["| FedPop", "posterior"],
                                                  ["| FedPop", "MAP plug-in"],
                                                  ["| FedAvg", "point estimate"]]
    assert "0.0400 ± 0.0000" in rows[1] and "(3 runs, seeds 0,1)" in table


def test_the_conformal_table_averages_seeds_and_states_each_acceptance_verdict():
    from bench.published_tables import s1_conformal_table

    def run(seed, coverage, size, shot_coverage, plugin_size):
        clean = {"coverage": coverage, "mean_set_size": size, "client_min": coverage - 0.05,
                 "clients_below": 2, "per_client": [coverage] * 10}
        figures = {"threshold": 0.9, "coverage_bound": None, "clean": clean,
                   "rotate 60": clean, "unseen labels": clean}
        shot = {**figures, "coverage_bound": 0.91,
                "clean": {**clean, "coverage": shot_coverage}}
        sketch = {**figures, "coverage_bound": 0.9002, "coverage_upper_bound": 0.92}
        plugin = {**figures, "clean": {**clean, "mean_set_size": plugin_size}}
        return {"label": "M", "score": "lac", "seed": seed, "rounds": 30, "results": [
            {"alpha": 0.1, "method": "exact", "bytes_up_per_client": 11768.0,
             "predictives": {"predictive": figures, "map_plugin": plugin}},
            {"alpha": 0.1, "method": "one-shot", "bytes_up_per_client": 392.0,
             "predictives": {"predictive": shot}},
            {"alpha": 0.1, "method": "sketch", "bytes_up_per_client": 928.0,
             "predictives": {"predictive": sketch}}]}

    # exact: 0.910 ± 0.010, +1.0 point from 0.9 (within 1.5); FedCP-QQ 0.870 ± 0.010 against
    # its stated 0.91 (4 SE below: fails); sketch 0.910 in [0.9002, 0.92] (holds)
    table = s1_conformal_table([run(0, 0.90, 2.0, 0.86, 2.5), run(1, 0.92, 3.0, 0.88, 2.0)])
    row = next(line for line in table.splitlines()
               if line.startswith("| M | LAC | headline | 0.1"))
    assert "| 0,1 | 0.910 ± 0.010 | holds (+1.0 points, +1.0 SE) |" in row
    assert "4 of 20" in row and "2.50 ± 0.50" in row
    assert "0.910 ± 0.010 [≥ 0.900, ≤ 0.920] | holds |" in row
    assert "0.870 ± 0.010 (≥ 0.910) | **fails** |" in row
    assert "| 11,768 / 928 / 392 |" in row
    # the set sizes at alpha = 0.1: posterior 2.50 against plug-in 2.25: fails
    assert "M, LAC: posterior 2.50 against plug-in 2.25, **fails**" in table


def s1_record(label, seed, ece, nll, plugin=False):
    summary = {"accuracy": 0.9, "confidence": 0.95, "ece": ece, "mce": 0.3, "brier": 0.1,
               "nll": nll, "bytes_up": 1000.0}
    if plugin:
        summary["map_plugin"] = dict(summary, ece=2 * ece, nll=2 * nll)
    return {"label": label, "seed": seed, "rounds": 30, "novel": False, "summary": summary,
            "curve": [0.9] * 30}


def test_the_full_s1_table_bolds_a_figure_only_beyond_the_standard_error_of_the_difference():
    from bench.published_tables import s1_full_table

    # A's ECE 0.010 ± 0.001 against B's 0.012 ± 0.001: the difference 0.002 exceeds the
    # difference's standard error sqrt(2) * 0.001 = 0.0014, so A's ECE is bold; A's NLL
    # 0.20 ± 0.05 against B's 0.21 ± 0.05 is within it, so no NLL is bold and the note says so
    records = []
    for seed, d in enumerate((-1, 0, 1)):
        e, n = 0.001 * math.sqrt(3) * d, 0.05 * math.sqrt(3) * d  # stdev sqrt(3)·step -> se step
        records += [s1_record("A", seed, 0.010 + e, 0.20 + n, plugin=True),
                    s1_record("B", seed, 0.012 + e, 0.21 - n)]
    table = s1_full_table(records)
    row_a = next(line for line in table.splitlines() if line.startswith("| A | "))
    assert "**0.0100 ± 0.0010**" in row_a and "**0.200" not in table
    assert "in NLL (best mean A; within one standard error: B)" in table
    assert "| A (MAP plug-in) | 0,1,2 |" in table  # the plug-in beside the posterior


def test_the_seeds_colearn_table_pairs_each_peer_by_seed():
    import numpy as np

    from bench.published_tables import seeds_colearn_table

    def run(accuracy):
        return {"accuracy": accuracy, "ece": 0.02, "nll": 0.3, "seconds": 40.0,
                "bytes_up_per_client_round": 7280.0, "bytes_down_per_client_round": 7493.0}

    ours, il = [0.95, 0.93, 0.94], [0.93, 0.92, 0.90]
    cache = {f"rows|colearn|2|{s}|100|relay=sets": run(a) for s, a in enumerate(ours)}
    cache |= {f"rows|il|2|{s}|100|relay=sets": run(a) for s, a in enumerate(il)}
    cache["rows|il|2|3|100|relay=sets"] = run(0.5)  # a seed CoLearn lacks: not paired
    diffs = 100 * (np.array(ours) - np.array(il))  # numpy as the reference
    expected = f"{diffs.mean():+.2f} ± {diffs.std(ddof=1) / np.sqrt(3):.2f}"
    row = next(line for line in seeds_colearn_table(cache).splitlines()
               if line.startswith("| 2 | "))
    assert row.startswith(f"| 2 | {expected} |")


# --- issue 41: the timing benches of the inference layer and the benches typed by hand ------

RUN = PROVENANCE | {"worktree": "clean", "seeds": [0], "torch": "2.14.1", "threads": 1,
                    "load_before": [3.25, 2.0, 1.5], "load_after": [4.0, 2.5, 1.75]}


def _row(table: str, start: str) -> str:
    return next(line for line in table.splitlines() if line.startswith(start))


def test_a_target_verdict_holds_on_its_bound_and_fails_past_it():
    from bench.published_tables import target_verdict

    assert target_verdict(300.0, 300) == "holds"
    assert target_verdict(299.9, 300) == "does not hold"
    assert target_verdict(0.10, 0.10, at_least=False) == "holds"
    assert target_verdict(0.1001, 0.10, at_least=False) == "does not hold"


def test_a_bench_table_shows_the_newest_run_and_its_provenance_and_load():
    from bench.published_tables import conjugate_table

    def run(ratio, stats, commit):
        return RUN | {"commit": commit, "num_classes": 100, "columns": 513, "n": 20_000,
                      "batch": 2048, "repeats": 21, "ratio_vs_adam": ratio,
                      "objective_gap_adam": 83.4, "objective_gap_ours": 0.0,
                      "relative_objective_gap_adam": 8.2e-6, "stats_vs_forward": stats,
                      "stats_vs_forward_median": stats, "stats_vs_forward_paper_cnn": 0.003,
                      "time_exact_ms": 2.0, "time_adam_ms": 2.0 * ratio, "adam_steps": 3524,
                      "time_statistics_ms": 1.0, "time_forward_ms": 1.0 / stats,
                      "time_statistics_paper_cnn_ms": 0.5, "time_forward_paper_cnn_ms": 170.0}

    table = conjugate_table([run(2000.0, 0.05, "old1234"), run(250.0, 0.109, "new5678")])
    assert "old1234" not in table  # the newest run is the one shown
    solver = _row(table, "| server MAP")
    assert "250x faster" in solver and solver.endswith("| ≥ 300x | does not hold |")
    assert _row(table, "| objective J").endswith("| holds |")  # Adam's gap 83.4 > ours 0
    assert _row(table, "| statistics pass, batch 2,048, MLP").endswith(
        "10.9% of it (ratio of medians 10.9%) | < 10% | does not hold |")
    source = table.splitlines()[-1]
    for text in ("newest of 2 run(s)", "CPU Test (AVX2)", "2026-11-28", "commit new5678 (clean)",
                 "seeds 0;", "torch 2.14.1 with 1 thread(s)", "3.25 / 2.00 / 1.50 before",
                 "4.00 / 2.50 / 1.75 after"):
        assert text in source, text


def test_the_subnet_laplace_table_has_a_column_per_backend_and_issue_6s_targets():
    from bench.published_tables import subnet_laplace_table

    peers = ("laplace-torch FullSubnetLaplace AsdlGGN",
             "laplace-torch FullSubnetLaplace CurvlinopsGGN (default)")
    record = RUN | {"n_params": 17610, "subnet_size": 800, "fit_on": 500, "predict_on": 500,
                    "repeats": 5, "select_s": 0.01, "peer_select_s": 0.03,
                    "same_selected_variances_as_peer": True, "fit_s": 0.1,
                    "predict_s": 0.05, "peer_fit_s": dict(zip(peers, (0.19, 1.0), strict=True)),
                    "peer_predict_s": dict(zip(peers, (10.0, 9.0), strict=True)),
                    "fit_ratio": 1.9, "predict_ratio": 180.0, "max_prob_diff": 2e-5}
    table = subnet_laplace_table([record])
    header = table.splitlines()[0]
    assert "laplace-torch AsdlGGN (s)" in header and "CurvlinopsGGN (default) (s)" in header
    assert _row(table, "| fit").endswith("| 1.9x | ≥ 2x | does not hold |")
    assert _row(table, "| GLM-probit").endswith("| 180x | ≥ 50x | holds |")
    assert _row(table, "| largest absolute").endswith("| ≤ 1e-5 | does not hold |")
    assert "| 3.0x | – | – (no target) |" in _row(table, "| subnet selection")
    # every row of the table has as many cells as its header
    rows = [line for line in table.splitlines() if line.startswith("|")]
    assert len({line.count(" | ") for line in rows if not line.startswith("|---")}) == 1


def _fedsi_record(fit_ratio: float, quick: bool = False) -> dict:
    peers = ("AsdlGGN", "BackPackGGN")
    return RUN | {"subnet_size": 3925, "n_train": 250, "n_test": 2500, "data": "mnist-5k",
                  "fit_s": 1.0, "fit_cold_s": 2.0, "predict_s": 1.5, "select_s": 0.02,
                  "marginal_s": 0.8, "fit_ratio_with_marginals": fit_ratio / 1.8,
                  "peer_fit_s": dict.fromkeys(peers, fit_ratio),
                  "peer_fit_cold_s": dict.fromkeys(peers, 9.0),
                  "peer_predict_s": dict.fromkeys(peers, 90.0), "fit_ratio": fit_ratio,
                  "fit_ratio_first_call": 4.5, "predict_ratio": 60.0, "max_prob_diff": 1e-7,
                  "max_prob_diff_paper_prior": 1e-8, "max_prob_diff_prior_precision_1": 1e-7,
                  "max_glm_vs_map": {"paper_prior": 1e-5, "prior_precision_1": 0.1},
                  "peak_mib": {"ours": 780.0, "laplace-torch AsdlGGN": 1046.0,
                               "laplace-torch BackPackGGN": 747.0},
                  "round": {"clients": 10, "round": 22.5, "local_training": 1.0,
                            "selection": 0.2, "laplace_fit": 21.0, "messages": 0.3,
                            "upload_bytes_per_client": 629000}, "quick": quick}


def test_the_fedsi_table_leaves_quick_runs_out_and_judges_issue_13s_targets():
    from bench.published_tables import fedsi_table

    table = fedsi_table([_fedsi_record(6.6), _fedsi_record(1.0, quick=True)])
    assert "newest of 1 run(s)" in table  # the --quick smoke run is not a published figure
    assert _row(table, "| fit, steady").endswith("| 6.6x | ≥ 5x | holds |")
    assert _row(table, "| GLM-probit").endswith("| 60x | ≥ 50x | holds |")
    assert "| 780 | 1,046 | 747 |" in _row(table, "| peak memory")
    assert "22.5 CPU-s = local training 1.0 + selection 0.2 + the upload's standard" in table
    assert fedsi_table([_fedsi_record(1.0, quick=True)]).startswith("No runs")


def test_the_calibration_table_takes_each_contenders_best_round_against_netcals_best():
    from bench.published_tables import calibration_table

    times = {"netcal ECE+MCE": [1.2, 1.0], "ours ece+mce+brier (3 calls)": [0.09, 0.08],
             "ours evaluate (1 call)": [0.05, 0.06], "ours evaluate, torch sweep": [0.2, 0.25]}
    record = RUN | {"rows": 1_000_000, "classes": 100, "bins": 15, "rounds": 2,
                    "times_s": times, "floor_s": 0.025, "native_sweep": "avx512",
                    "ece_abs_diff_vs_netcal": 1e-17, "mce_abs_diff_vs_netcal": 0.0}
    table = calibration_table([record])
    # best 1.0 / 0.08 = 12.5x (median 0.085); best 1.0 / 0.05 = 20.0x, on the bound
    assert _row(table, "| ours ece+mce+brier").endswith(
        "| 0.0800 | 0.0850 | 12.5x | ≥ 10x | holds |")
    assert _row(table, "| ours evaluate (1 call)").endswith("| 20.0x | ≥ 20x | holds |")
    assert _row(table, "| ours evaluate, torch sweep").endswith("| 5.0x | – | – (no target) |")
    assert "costs 2.0 reads of the array" in table and "4.0x the native kernel's" in table


def test_the_scale_table_averages_the_rounds_after_round_0_and_judges_issue_28s_targets():
    from bench.published_tables import SCALE_SPLIT, simulate_scale_table

    def rounds(totals):
        return [{"round": r, "total": t, "cpu": t / 2, **dict.fromkeys(SCALE_SPLIT, t / 6)}
                for r, t in enumerate(totals)]

    record = RUN | {"clients": 16000, "peer_clients": 4000, "seconds_per_round": 8.5,
                    "slowest_round": 9.0, "peak_rss_gb": 2.5, "peer_peak_rss_gb": 0.8,
                    "scaling": 4.25, "save_result_s": 0.6, "load_run_s": 2.0,
                    "peer_save_result_s": 0.2, "peer_load_run_s": 0.5, "accuracy": 0.29,
                    "huge_pages": True, "rounds": rounds([30.0, 8.0, 9.0]),
                    "peer_rounds": rounds([7.0, 2.0, 2.0])}
    table = simulate_scale_table([record])
    # round 0 (30 s: data and set-up) is not in the mean: (8 + 9) / 2
    assert _row(table, "| 16,000 |").startswith("| 16,000 | 8.50 | 9.00 | 4.25 | 1.42 |")
    assert _row(table, "| 4,000 |").startswith("| 4,000 | 2.00 | 2.00 |")
    assert _row(table, "| at most 8 s").endswith("| does not hold |")
    assert _row(table, "| no more memory").endswith("| 2.50 GB | holds |")
    assert "| 4.00x | – (a measurement) |" in _row(table, "| `load_run`")
    assert "FedLog (`feature_scale` heldout (FedLog's default; not recorded);" in table
    assert "FedLog (`feature_scale` 1; issue 28's" in simulate_scale_table(
        [record | {"feature_scale": 1.0}])


def test_the_flower_table_judges_issue_28s_ratio_and_the_equal_ece():
    from bench.published_tables import FLOWER_SPLIT, flower_table

    record = RUN | {"strategy": "fedlog", "rounds": 3, "clients": 3,
                    "simulator_round_s": 0.4, "flower_round_s": 8.0,
                    "ratio_flower_over_simulator": 20.0, "flower_process_alone_s": 1.4,
                    "client_import_alone_s": 2.0, "flower_floor_s": 4.4,
                    "ratio_flower_floor_over_simulator": 11.0,
                    "flower_floor_with_torch_s": 6.4,
                    "ratio_flower_floor_with_torch_over_simulator": 16.0,
                    "ece_simulator": 0.112818, "ece_flower": 0.112818,
                    "flower_message_cpu_s": 5.0,
                    # the keys as bench/flower.py writes them (flower_start -> flower_start_s)
                    **{f"flower_{k.removeprefix('flower_')}_s": 0.5 for k in FLOWER_SPLIT}}
    table = flower_table([record])
    assert _row(table, "| Flower round").endswith("| 8.00 | 20.0x | ≤ 8x | does not hold |")
    assert _row(table, "| pooled ECE").endswith("| equal | holds |")
    assert "| 11.0x |" in _row(table, "| Flower's own floor")
    unequal = flower_table([record | {"ece_flower": 0.2}])
    assert _row(unequal, "| pooled ECE").endswith("| does not hold |")


def test_the_tables_pull_sleep_is_the_benchs_which_is_flowers():
    pytest.importorskip("flwr")
    from bench.flower import PULL_SLEEP
    from bench.published_tables import PULL_SLEEP_S

    assert PULL_SLEEP_S == PULL_SLEEP


def test_the_calibration_table_lists_every_stored_runs_ratios_when_there_are_several():
    from bench.published_tables import calibration_table

    def run(commit, netcal, load):
        times = {"netcal ECE+MCE": [netcal], "ours ece+mce+brier (3 calls)": [0.1],
                 "ours evaluate (1 call)": [0.05], "ours evaluate, torch sweep": [0.2]}
        return RUN | {"commit": commit, "rows": 10, "classes": 3, "bins": 15, "rounds": 1,
                      "times_s": times, "floor_s": 0.025, "native_sweep": "native",
                      "ece_abs_diff_vs_netcal": 0.0, "mce_abs_diff_vs_netcal": 0.0,
                      "load_before": [load, 1.0, 1.0]}

    assert "Every stored run" not in calibration_table([run("a", 1.0, 0.5)])
    table = calibration_table([run("quiet01", 0.9, 0.5), run("busy002", 3.0, 8.0)])
    assert _row(table, "| quiet01,") == "| quiet01, 2026-11-28 | 0.50 | 0.9000 | 9.0x | 18.0x |"
    assert _row(table, "| busy002,") == "| busy002, 2026-11-28 | 8.00 | 3.0000 | 30.0x | 60.0x |"
    assert _row(table, "| ours evaluate (1 call)").endswith("| 60.0x | ≥ 20x | holds |")


def test_the_heads_table_shows_the_first_seed_and_each_heads_acceptance_at_every_seed():
    from bench.published_tables import heads_calibration_table

    def scores(nll: float) -> dict:
        return {"accuracy": 0.97, "ece": 0.02, "nll": nll, "confidence": 0.98}

    def record(seed: int, accepted: bool) -> dict:
        return {"seeds": [seed], "test_rows": 540, "commit": "abc1234", "date": "2026-11-29",
                "machine": "CPU test",
                "rows": {"network": scores(0.08),
                         "laplace": {"default": scores(0.09), "map_plugin": scores(0.16),
                                     "accepted": True},
                         "conjugate": {"default": scores(0.16), "map_plugin": scores(0.16),
                                       "accepted": accepted}}}

    # an older run of seed 1 is replaced by its newest
    table = heads_calibration_table([record(0, False), record(1, True), record(1, False)])
    assert table.startswith("Seed 0, 540 test images:")
    assert "| laplace | default | 0.9700 | 0.0200 | 0.0900 | 0.980 | 1.12x |" in table
    assert "- laplace: **holds** (accepted at 2 of 2 seeds)" in table
    assert "- conjugate: **does not hold** (accepted at 0 of 2 seeds; not at 0, 1)" in table


def test_the_temperature_table_shows_each_seeds_newest_run_and_counts_the_seeds_per_claim():
    from bench.published_tables import temperature_scaling_table

    def scores(ece: float, nll: float, brier: float) -> dict:
        return {"accuracy": 0.98, "ece": ece, "nll": nll, "brier": brier}

    def row(seed: int, ece_after: float) -> dict:
        return {"seed": seed, "temperature": 2.5, "test_rows": 445,
                "before": scores(0.02, 0.14, 0.04), "after": scores(ece_after, 0.07, 0.03),
                "step_bytes_up": 44_800, "step_bytes_down": 44_000,
                "run_bytes_up": 3_000_000}

    def record(rows: list[dict]) -> dict:
        return {**PROVENANCE, "seeds": [r["seed"] for r in rows], "strategy": "fedlog",
                "dataset": "digits", "clients": 20, "partition": "shards:2", "rounds": 30,
                "calibrate": "temperature:0.2", "rows": rows}

    # seed 1's first run (ECE down) is replaced by its newest (ECE up)
    table = temperature_scaling_table([record([row(0, 0.01), row(1, 0.01)]),
                                       record([row(1, 0.03), row(2, 0.01)])])
    assert table.startswith("`fedlog` on `digits`, 20 clients, `shards:2`, 30 rounds")
    assert ("| 0 | 2.50 | 0.9800 → 0.9800 | 0.0200 → 0.0100 | 0.140 → 0.070 | "
            "0.0400 → 0.0300 | 44,800 / 44,000 | 1.5% |") in table
    assert "- temperature scaling lowers the test NLL: **holds at 3 of 3 seeds**." in table
    assert ("- it lowers the ECE: **holds at 2 of 3 seeds** (does not hold at seed 1)."
            in table)
    assert "- it keeps the accuracy: **holds at 3 of 3 seeds**." in table
    assert "(2 runs, seeds 0,1,2)" in table and "commit abc1234" in table


def test_the_conformal_methods_table_reads_bytes_and_judges_each_thresholds_coverage():
    from bench.published_tables import conformal_methods_table

    def run(seed: int, exact: float, sketch: float, shot: float) -> dict:
        def figures(coverage: float, low=None, up=None) -> dict:
            return {"coverage_bound": low, "coverage_upper_bound": up,
                    "clean": {"coverage": coverage, "per_client": [coverage] * 10}}

        return {"label": "M", "score": "lac", "seed": seed, "rounds": 30,
                "held_out_rows": 500, **PROVENANCE, "results": [
                    {"alpha": 0.1, "method": "exact", "bytes_up_per_client": 11152.0,
                     "steps": 17, "bytes_down": 99840,
                     "predictives": {"predictive": figures(exact)}},
                    {"alpha": 0.1, "method": "sketch", "bytes_up_per_client": 928.0,
                     "steps": 1, "bytes_down": 3520,
                     "predictives": {"predictive": figures(sketch, 0.9002, 0.92)}},
                    {"alpha": 0.1, "method": "one-shot", "bytes_up_per_client": 392.0,
                     "steps": 1, "bytes_down": 4160,
                     "predictives": {"predictive": figures(shot, 0.91)}}]}

    # a run without the sketch is left out; exact 0.900 ± 0.010 (within 1.5 points); sketch
    # 0.910 ± 0.010 in [0.9002, 0.92]; FedCP-QQ 0.870 ± 0.010, 4 SE below its 0.91: fails;
    # seed 1's sketch (0.90) below its exact (0.91)
    old = run(5, 0.9, 0.9, 0.9)
    old["results"] = old["results"][:1]
    table = conformal_methods_table([old, run(0, 0.89, 0.92, 0.86), run(1, 0.91, 0.90, 0.88)])
    assert table.startswith("S1 (M; 10 clients, 50 held-out rows a client;")
    assert "| 11,152 | 17 | 9,984 |" in table and "| 928 | 1 | 352 |" in table
    assert "| 392 | 1 | 416 |" in table
    assert ("within ±1.5 points of 1 − α: **holds at 1 of 1 score × predictive × α rows"
            in table)
    assert "within its stated bounds: **holds at 1 of 1 " in table
    assert "its stated bound (not more than two standard errors below it): **holds at 0 of 1" \
        in table and "(does not hold at LAC headline α = 0.1)." in table
    assert ("at or above the exact threshold's: **holds at 1 of 2 runs (seed × score × "
            "predictive × α)** (does not hold at seed 1 LAC headline α = 0.1).") in table
    assert "and less with `one-shot` than with `sketch`: **holds**." in table
    assert "(2 runs): CPU Test" in table


def mutation_record(module, kind, detected, scored, sample=None, seed=None, **extra):
    return {"module": module, "kind": kind, "resumed": False, "sample_size": sample,
            "seed": seed, "population": 300 if sample else None, "tests": ["tests/t.py"],
            "killed": detected, "timeout": 0, "crashed": 0, "detected": detected,
            "survived": scored - detected + 1, "no_tests": 0, "equivalent": 1,  # 1 survivor
            # of them is a listed equivalent
            "total": scored + 1, "scored": scored, "score": detected / scored,
            "ci95": [0.7027, 0.9275] if sample else None, "wall_s": 90.0, "worktree": "clean",
            **PROVENANCE, **extra}


def test_the_mutation_table_shows_the_newest_run_of_each_module_kind_and_sample():
    from bench.published_tables import mutation_table

    records = [mutation_record("b.py", "sample", 20, 39, sample=40, seed=0),
               mutation_record("b.py", "sample", 33, 39, sample=40, seed=0, commit="def5678"),
               mutation_record("b.py", "retest", 39, 39, sample=40, seed=0),
               mutation_record("a.py", "full", 36, 40, timeout=2)]
    lines = mutation_table(records).splitlines()
    rows = [line for line in lines if line.startswith("| `")]
    assert [row.split(" | ")[0] for row in rows] == ["| `a.py`", "| `b.py`", "| `b.py`"]
    full, sample, retest = rows
    assert "| every mutant |" in full and "| 36 (incl. 2 timeouts) | 4 | 1 |" in full
    assert "| 36 / 40 = 90.0% |" in full and "| 1.5 min |" in full  # no interval: the module
    assert "| sample of 40 of 300, seed 0 |" in sample
    assert "| 33 / 39 = 84.6% (70.3-92.8) |" in sample and "def5678" in sample  # the newer
    assert retest.startswith("| `b.py` | retest of the survivors (sample of 40")
    assert lines[-1].startswith("Source: `bench/results/mutation.jsonl` (3 runs)")
    assert "No runs" in mutation_table([])
