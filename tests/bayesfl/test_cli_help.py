"""What the ``bayesfl`` command says about itself: one-line usage errors, a ``--help`` whose
examples run and that lists every partition form, a strategy listing with whole summaries and
each option's default and meaning, and a ``bayesfl flower`` that offers only what Flower takes
(issue 26, "smaller frictions")."""

import re
import shlex
from pathlib import Path

import pytest

from bayesfl.cli import RUN_EXAMPLES, RUN_TOML_EXAMPLE, _parser, main, option_docs
from bayesfl.data.partition import PARTITION_SCHEMES
from bayesfl.strategies import STRATEGIES

# appended to each example: the flags given last win, so every example runs in seconds
QUICK = ["--rounds", "1", "--local-epochs", "1", "--no-progress", "--threads", "1"]


def _help(*command: str) -> str:
    parser = _parser()
    if not command:
        return parser.format_help()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command[0]]
    return sub.format_help()


# ---- usage errors are one line ---------------------------------------------------------------
@pytest.mark.parametrize(("argv", "expected"), [
    (["run", "--rounds", "two"], "argument --rounds: invalid int value: 'two'"),
    (["run", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ([], "the following arguments are required: command"),
    (["flower", "--clients", "x"], "argument --clients: invalid int value: 'x'"),
])
def test_a_usage_error_is_one_line_with_exit_code_2(capsys, argv, expected):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # argparse alone prints the usage block (14 lines) first
    assert expected in err and "--help" in err and "usage:" not in err


# ---- bayesfl run --help ----------------------------------------------------------------------
def test_run_help_lists_every_partition_form():
    text = " ".join(_help("run").split())
    for form in PARTITION_SCHEMES.values():
        assert " ".join(form.split()) in text, form
    assert "labels:K" in text


def test_every_example_of_run_help_is_in_the_help_text():
    text = _help("run")
    for example in RUN_EXAMPLES:
        assert f"  {example}\n" in text
    for line in RUN_TOML_EXAMPLE.splitlines():
        assert f"  {line}\n" in text


def test_the_option_examples_of_the_help_are_options_of_their_strategy():
    """`--option K=V` in a flag's help is an option of the default strategy, in an example one
    of the example's strategy (the help once showed `--option alpha=0.01`, which the default
    strategy refuses)."""
    from bayesfl.settings import SETTINGS

    for setting in SETTINGS:
        for key in re.findall(r"--option (\w+)=", setting.help):
            assert key in option_docs("fedlog"), (setting.names, key)
    for example in RUN_EXAMPLES:
        words = shlex.split(example)
        strategy = words[words.index("--strategy") + 1] if "--strategy" in words else "fedlog"
        for i, word in enumerate(words):
            if word == "--option":
                assert words[i + 1].split("=")[0] in option_docs(strategy), example


@pytest.mark.slow
def test_every_example_of_run_help_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.toml").write_text(RUN_TOML_EXAMPLE)  # the file the examples name
    for i, example in enumerate(RUN_EXAMPLES):
        words = shlex.split(example)[1:]  # without the program name
        code = main([*words, *QUICK, "--out", str(tmp_path / f"example{i}")])
        assert code == 0, f"bayesfl run --help example failed: {example}\n" \
                          f"{capsys.readouterr().err}"


# ---- bayesfl strategies ----------------------------------------------------------------------
def test_the_listing_shows_each_strategy_with_a_whole_first_sentence(capsys):
    assert main(["strategies"]) == 0
    listed = capsys.readouterr().out
    lines = {line.split()[0]: line for line in listed.splitlines()
             if line and not line.startswith(" ") and line.split()[0] in STRATEGIES}
    assert set(lines) == set(STRATEGIES)
    for name, line in lines.items():
        summary = line[len(name):].strip()
        assert summary.endswith("."), f"{name}: cut mid-sentence: {summary!r}"
        assert "module doc" not in summary, name
    # FedSI-Fac's docstring's first line stops inside a parenthesis; the sentence goes on
    assert "(all stds sent; a baseline of the paper's section IV)." in lines["fedsi-fac"]


def test_a_default_that_the_class_names_is_shown_as_that_value(capsys):
    assert main(["strategies"]) == 0
    listed = capsys.readouterr().out
    assert "posterior=subnet_full" in listed  # FedSI's None means subnet_full (the README's)
    assert "posterior=diag_all" in listed     # FedSI-Fac's
    assert "posterior=None" not in listed
    assert option_docs("fedsi")["posterior"][0] == "subnet_full"


def test_one_strategy_in_full_gives_each_option_its_default_and_meaning(capsys):
    assert main(["strategies", "fedsi"]) == 0
    shown = capsys.readouterr().out
    options = option_docs("fedsi")
    documented = {o: m for o, (_, m) in options.items() if m}
    assert len(documented) >= 20  # FedSI's declared options
    for option in options:
        assert f"  {option} (default " in shown
    # the meaning, whole, as FedSI declares it (wrapped, not cut)
    words = " ".join(shown.split())
    assert ('"subnet_full" (FedSI), "subnet_diag" (diagonal posterior on the subnet), '
            '"diag_all" (FedSI-Fac; its default) (open in the paper)') in words


def test_one_strategy_in_full_says_what_each_option_accepts(capsys):
    # from the declarations: kinds, bounds, choices
    assert main(["strategies", "fedpa", "fedsi"]) == 0
    shown = capsys.readouterr().out
    assert "  burn_in_epochs (default 1; an integer >= 1)" in shown
    assert "  screening_ratio (default 10.0; a finite number or none >= 1)" in shown
    assert "  posterior (default subnet_full; one of subnet_full, subnet_diag, diag_all or none)" \
        in shown


@pytest.mark.parametrize(("strategy", "option", "words"), [
    ("fedlog", "mc_samples", "Laplace draws"),                     # Args: of __init__
    ("fedlog-dp-local", "delta", "privacy budget"),                # `epsilon, delta: ...`
    ("fedavg", "aggregation", ""),                                 # a base class's Args:
])
def test_meanings_come_from_args_sections_and_base_classes(strategy, option, words):
    _, meaning = option_docs(strategy)[option]
    assert meaning and words in meaning


def test_every_option_has_a_meaning():
    # declared with its help (bayesfl.strategies.registry refuses an option without one)
    missing = {name: sorted(o for o, (_, m) in option_docs(name).items() if not m)
               for name in STRATEGIES}
    assert {name: options for name, options in missing.items() if options} == {}


def test_an_unknown_strategy_name_is_a_one_line_error(capsys):
    assert main(["strategies", "fedavgg"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown strategy 'fedavgg'" in err
    assert "did you mean 'fedavg'?" in err


# ---- bayesfl flower --help -------------------------------------------------------------------
def test_flower_help_offers_no_flag_flower_refuses_and_says_why():
    from bayesfl.flower.command import NOT_ON_FLOWER

    text = _help("flower")
    for name, why in NOT_ON_FLOWER.items():
        assert f"--{name}:" in text  # in the epilog, with the reason
        assert f"[--{name}" not in text and f"--{name} " not in text.split("Not offered")[0]
        assert " ".join(why.split()[:4]) in " ".join(text.split())


def test_every_flag_bayesfl_flower_offers_is_accepted_by_the_flower_run():
    pytest.importorskip("flwr")
    from bayesfl.flower.command import NOT_ON_FLOWER, run_config
    from bayesfl.flower.protocol import parse_run_config
    from bayesfl.settings import SETTINGS

    value = {"strategy": "fedlog", "dataset": "gaussian_mixture", "clients": 3,
             "partition": "iid", "rounds": 1, "seed": 1, "data_seed": 2, "body": "mlp:8",
             "feature_dim": 4,
             "local_epochs": 1, "lr": 0.01, "batch_size": 8, "fraction": 1.0,
             "test_fraction": 0.25, "novel_fraction": 0.34, "n_bins": 10,
             "calibrate": "temperature", "conformal": "aps:0.1", "device": "cpu",
             "batched": False,
             "authenticate": True, "strategy_options": {"mc_samples": 10},
             "dataset_options": {"n": 90}, "out": "/tmp/out", "resume": True, "force": False,
             "threads": 1, "progress": False, "download": False, "shift": ["noise:0.1"],
             "ood": ["unseen-labels"]}
    offered = [s for s in SETTINGS if s.target not in NOT_ON_FLOWER]
    assert {s.target for s in SETTINGS} <= set(value)
    needs = {"dataset_options": {"dataset": "gaussian_mixture"},
             "download": {"dataset": "mnist"}}  # options of that data set (nothing is loaded)
    for setting in offered:
        settings = {**needs.get(setting.target, {}), setting.target: value[setting.target]}
        config = run_config(settings, Path("/tmp/out"))
        parse_run_config(config)  # raises ConfigError for a setting Flower refuses
    # and what is not offered is refused (or, progress, has no meaning) on Flower
    with pytest.raises(Exception, match="authenticate"):
        parse_run_config(run_config({"authenticate": True}, Path("/tmp/out")))


def test_a_flag_flower_does_not_take_is_refused_with_the_reason(capsys):
    assert main(["flower", "--authenticate", "--clients", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--authenticate is not offered on Flower" in err and "supernode-auth" in err
