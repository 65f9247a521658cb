"""The hostile-input sweep (``tests/hostile_cases.py``): every case of a surface either gets a
clear error (a CLI exits 2 with one paragraph and no traceback and leaves no run folder; an HTTP
request its status with an OpenAI error body while ``/health`` still answers; an API call a
one-paragraph ``CompressError``) or, where marked, succeeds. About 200 cases, all with the
suite."""

import os
import shutil

import pytest
import torch

from tests import hostile_cases as hc

SURFACES = ("pipeline", "decoder", "serve-cli", "http", "api")


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    srv: dict = {}
    cwd, threads = os.getcwd(), torch.get_num_threads()
    os.chdir(root)  # relative outputs/ land in the temporary folder
    torch.set_num_threads(1)
    try:
        yield hc.all_cases(hc.Fixtures(root), srv)
    finally:
        if "srv" in srv:
            srv["srv"].close()
        os.chdir(cwd)
        torch.set_num_threads(threads)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("surface", SURFACES)
def test_every_hostile_input_gets_a_clear_error(cases, surface):
    chosen = [c for c in cases if c.surface == surface]
    assert chosen, surface
    failed = []
    for c in chosen:
        try:
            ok, detail = c.run()
        except Exception as e:  # the case's own failure, reported with the others
            ok, detail = False, f"{type(e).__name__}: {e}"
        if not ok:
            failed.append(f"{c.name}: {detail}")
    assert not failed, "\n".join(failed)
