"""request.json's size counted without writing it (`JobFiles.request_document_size`).

Admission charges a job's request.json against its key's storage quota (`harvest.cost.kept_bytes`)
in the assessing child, which counts it from the prompts one at a time instead of encoding the
whole document (two more copies of a 48 MB body there). The count must be the written file's
size exactly: checked against the bytes `write_request` puts on local storage, for requests
whose prompts need every kind of escaping pydantic's JSON does, and whose other fields vary.
"""

from __future__ import annotations

import os

import pytest

from harvest.jobfiles import JobFiles
from harvest.request import HarvestRequest
from harvest.storage import Storage

PROMPTS = {
    "one ASCII prompt": ["The sky is"],
    "escapes": ['a "quoted" word', "back\\slash", "tab\tnew\nline\rreturn", "\x00\x01\x1f\x7f control", "</script>"],
    "non-ASCII": ["é", "naïve café", "日本語のテキスト", "emoji 🙂 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "\u2028\u2029 separators", "\ud7ff\ue000\U0010ffff"],
    "many and long": [f"prompt {k} " + "lorem ipsum dolor " * (k % 50) for k in range(4096)],
}


@pytest.mark.parametrize("prompts", PROMPTS.values(), ids=PROMPTS.keys())
@pytest.mark.parametrize("fields", [
    {},
    {"layers": [0, 3, 7], "shard_size": 4096, "batch_size": 8, "add_special_tokens": False},
    {"layers": "all", "project_onto": {"data": "AACAPwAAAEAAAEBAAACAQA==", "dtype": "float32", "shape": [2, 2]}},
], ids=["defaults", "layers and sizes", "all layers, projection"])
def test_the_counted_size_is_the_written_files_size(tmp_path, prompts, fields):
    request = HarvestRequest(model="llama-tiny", prompts=prompts, **fields)
    files = JobFiles(Storage(str(tmp_path)))
    files.write_request(request)
    written = os.path.getsize(tmp_path / JobFiles.REQUEST)
    assert JobFiles.request_document_size(request) == written == len(JobFiles.request_document(request))
    assert files.read_request() == request  # the file is the request, not only its size


def test_the_count_is_not_a_constant_per_prompt(tmp_path):
    """One character more in one prompt, or one escape, moves the count by what it writes."""
    base = HarvestRequest(model="llama-tiny", prompts=["a", "b"])
    size = JobFiles.request_document_size(base)
    assert JobFiles.request_document_size(base.model_copy(update={"prompts": ["a", "bc"]})) == size + 1
    assert JobFiles.request_document_size(base.model_copy(update={"prompts": ["a", "b", "c"]})) == size + 4  # ,"c"
    assert JobFiles.request_document_size(base.model_copy(update={"prompts": ["a", '"']})) == size + 1  # \"
    assert JobFiles.request_document_size(base.model_copy(update={"prompts": ["a", "é"]})) == size + 1  # 2 UTF-8 bytes
