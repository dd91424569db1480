"""The notebooks run top to bottom against the live stack (tests/client_fixtures.py), with
nbclient and a real kernel, as a researcher runs them against `make run`, on the real model
`smollm2-135m`; their figures are PNG outputs, both in this run and in the committed .ipynb
files, and PNG files they save (notebooks/figures/ holds the committed ones).

They share one data folder, as they do for a researcher: the first harvests the corpus, the
others find it finished (the client's resume) and harvest only what they add.
"""

from __future__ import annotations

import base64
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytest_plugins = ["tests.client_fixtures"]

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
# name → figures it draws
FIGURES = {"quickstart": 2, "train_sae": 2, "probe_projection": 2}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _pngs(notebook) -> list[bytes]:
    return [base64.b64decode(output["data"]["image/png"])
            for cell in notebook.cells if cell.cell_type == "code"
            for output in cell.get("outputs", []) if "image/png" in output.get("data", {})]


def _errors(notebook) -> list[str]:
    return [f"{o['ename']}: {o['evalue']}" for cell in notebook.cells if cell.cell_type == "code"
            for o in cell.get("outputs", []) if o.get("output_type") == "error"]


@pytest.fixture(scope="module")
def notebook_env(client_api, tmp_path_factory):
    return {"ACS_API_BASE": client_api.base_url, "ACS_API_KEY": client_api.make_key(name="notebooks"),
            "HARVEST_NOTEBOOK_DATA": str(tmp_path_factory.mktemp("notebook-data")),
            # where the notebooks save their figures (notebooks/figures/ when a researcher runs them)
            "HARVEST_NOTEBOOK_FIGURES": str(tmp_path_factory.mktemp("notebook-figures"))}


@pytest.mark.parametrize("name", list(FIGURES))  # in this order: quickstart harvests first
def test_notebook_runs_against_the_stack_and_draws_its_figures(name, notebook_env, monkeypatch, tmp_path):
    committed = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    figures = _pngs(committed)
    assert len(figures) == FIGURES[name] and all(f.startswith(PNG_MAGIC) for f in figures)
    assert not _errors(committed)

    for key, value in notebook_env.items():
        monkeypatch.setenv(key, value)  # the kernel inherits them
    notebook = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs = []  # nothing carried over from the committed run
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert not _errors(notebook)
    drawn = _pngs(notebook)
    assert len(drawn) == FIGURES[name] and all(f.startswith(PNG_MAGIC) and len(f) > 5000 for f in drawn)
    saved = sorted(Path(notebook_env["HARVEST_NOTEBOOK_FIGURES"]).glob(f"{name}_*.png"))
    assert len(saved) == FIGURES[name] and all(f.read_bytes().startswith(PNG_MAGIC) for f in saved)
    nbformat.write(notebook, tmp_path / f"{name}.ipynb")  # kept beside the test's other files for a look
