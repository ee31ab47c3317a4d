"""Bad input to `python -m course`: one line on stderr and exit status 2, never a traceback."""

from __future__ import annotations

from course.__main__ import main


def fails_with(capsys, argv: list[str], message: str) -> None:
    """`main(argv)` exits 2 with exactly one stderr line, which contains `message`."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert message in err, err


def test_check_without_a_lab_names_the_labs(tmp_path, capsys):
    for lab in ("00-setup", "03-kernels"):
        (tmp_path / "labs" / lab).mkdir(parents=True)
        (tmp_path / "labs" / lab / f"{lab}.ipynb").write_text("{}")
    fails_with(capsys, ["check", "--root", str(tmp_path)],
               "say which lab to check: `make check LAB=NN-name` or `python -m course check "
               "NN-name` (labs: 00-setup, 03-kernels)")


def test_check_without_a_lab_or_labs(tmp_path, capsys):
    fails_with(capsys, ["check", "--root", str(tmp_path)], "(labs: none found under")
