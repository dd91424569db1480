"""`smollm2-135m` through the researcher's paths on the live stack (tests/client_fixtures.py:
the session's Prefect server, lane workers and an API): `Client.harvest` + `ActivationDataset`,
and a scheduled corpus refresh (the `corpus-refresh` deployment), each against the GGUF
reference within the bound of tests/smollm2_reference.py. Three short prompts: cheap.
"""

from __future__ import annotations

import uuid

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from harvest_client import ActivationDataset, Client
from tests.smollm2_reference import MODEL, PROMPTS, assert_layers_match

pytest_plugins = ["tests.client_fixtures", "tests.smollm2_fixtures"]


def test_client_dataset_and_a_corpus_refresh_on_the_real_model(client_api, harvest_stack, harvest_home, smollm2,
                                                                reference_streams, tmp_path):
    from prefect.deployments import run_deployment

    corpus = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"text": PROMPTS}), corpus)
    name = f"smollm2-{uuid.uuid4().hex[:8]}"
    # Started first, so its run overlaps the client's harvest.
    run = run_deployment("corpus-refresh/corpus-refresh", timeout=0, parameters={
        "corpus_url": str(corpus), "model": MODEL, "layers": [15], "shard_size": 2, "name": name, "part_size": 2})

    with Client(client_api.base_url, client_api.make_key(name="smollm2")) as client:
        summary = client.harvest(MODEL, PROMPTS, tmp_path / "data", layers=[0, 29], shard_size=2, progress=False)
    assert summary is not None
    for layer in (0, 29):
        dataset = ActivationDataset(tmp_path / "data", layer=layer, skip_bos=False)
        assert dataset.n_prompts == len(PROMPTS) and dataset.n_features == 576
        for p, (ids, ref) in enumerate(reference_streams):
            example = dataset.prompt(p)
            assert example.token_ids.tolist() == ids
            assert_layers_match(np.asarray(example.vectors)[None], ref, [layer], f"client layer {layer}")
    # By default the dataset leaves each prompt's first position out, as the statistics do.
    assert len(ActivationDataset(tmp_path / "data", layer=29)) == sum(len(ids) - 1 for ids, _ in reference_streams)

    status = harvest_stack.wait(str(run.id), timeout=300)
    assert status.status == "done", status
    refreshed = ActivationDataset(harvest_home / "storage" / "corpus" / name, layer=15, skip_bos=False)
    assert refreshed.n_prompts == len(PROMPTS)
    for p, (ids, ref) in enumerate(reference_streams):
        example = refreshed.prompt(p)
        assert example.token_ids.tolist() == ids
        assert_layers_match(np.asarray(example.vectors)[None], ref, [15], "corpus refresh")
