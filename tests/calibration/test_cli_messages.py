"""``bayesfl-calibrate``'s advice names its own flags, the library's names Python keywords
(issue 26: a logits CSV was told to "pass from_logits=True", a text client column was not
pointed to ``--client-column``)."""

import pytest

from calibration import load_predictions, report
from calibration.cli import main
from calibration.errors import CalibrationError

LOGITS = "label,c0,c1,c2\n0,2.5,-1.0,0.3\n1,-0.2,1.7,0.1\n2,0.1,0.2,3.0\n"
SITES = "label,site,c0,c1\n0,north,0.9,0.1\n1,south,0.2,0.8\n1,north,0.3,0.7\n"


@pytest.fixture
def csv(tmp_path):
    def write(text: str, name: str = "preds.csv"):
        path = tmp_path / name
        path.write_text(text)
        return path
    return write


def test_a_logits_csv_read_as_probabilities_is_told_to_pass_the_logits_flag(csv, capsys):
    assert main([str(csv(LOGITS))]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pass --logits" in err and "from_logits" not in err
    assert main([str(csv(LOGITS)), "--logits"]) == 0  # and the advice works


def test_the_same_mistake_in_python_is_told_the_keyword(csv):
    predictions = load_predictions(csv(LOGITS))
    with pytest.raises(CalibrationError, match="pass from_logits=True"):
        report(predictions.scores, predictions.labels, from_logits=False)


def test_a_text_column_is_pointed_to_client_column(csv, capsys):
    assert main([str(csv(SITES))]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "column 'site' is not numeric" in err and "--client-column site" in err
    assert main([str(csv(SITES)), "--client-column", "site"]) == 0  # and the advice works
    assert "north" in capsys.readouterr().out


def test_python_callers_get_the_keyword_beside_the_flag(csv):
    with pytest.raises(CalibrationError, match="client_key='site'"):
        load_predictions(csv(SITES))
    assert load_predictions(csv(SITES), client_key="site").client_ids.tolist() == [
        "north", "south", "north"]


def test_a_stray_text_cell_in_a_score_column_is_named_not_taken_for_client_ids(csv, capsys):
    assert main([str(csv("label,c0,c1\n0,0.9,0.1\n1,oops,0.8\n"))]) == 1
    err = capsys.readouterr().err
    assert "column 'c0' holds a non-number in row 2 ('oops'" in err
    assert "--client-column" not in err
