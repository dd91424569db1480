"""Admission on an API replica: a submit's cost known before it is paid for, within a budget.

Against the real app under uvicorn (the harvest tests' replica, whose `xl` lane takes shards
of at most 1 MiB) and the real tiny model's tokenizer; expected numbers come from the
tokenizer run in full and from the model's config, never from the code under test:
- refusals from the prompts' characters alone (no tokenizer run), naming limit and number;
- token counts equal to a full tokenization, prompts cut to the context;
- shards over the lane's `max_shard_bytes` refused naming the largest shard_size that fits;
- the replica's budget: places, bytes, a key's share, the queue, 503 `replica_busy`;
- six concurrent 48 MB bodies: the replica's RSS stays within its bound and another key's
  small submit is served meanwhile;
- a submit's tokens counted on one thread of an assessing child in a session of its own, whose
  group is at the admission nice, not by the replica (the kernel's per-thread CPU time, the
  sessions and the group's nice, from /proc);
- integers written `514.0` accepted, `514.5` refused, on every request schema;
- malformed input on the routes without a key (bad links, JSON nested 100,000 deep) is 4xx.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest

from api.errors import ReplicaBusy
from harvest.errors import InvalidRequest
from harvest.lanes import Lane
from harvest.settings import get_settings
from testbed import http_calls
from tests.api_fixtures import ApiServer
from tests.proc_threads import autogroup_nice, slices_supported, thread_slices, thread_stats

REPO = Path(__file__).resolve().parent.parent

SHARD_LIMIT = 1 << 20
"""max_shard_bytes of the `xl` lane of the `harvest_api` replica (tests/api_fixtures.py)."""


@pytest.fixture(scope="module")
def replica(harvest_api):
    """The harvest tests' API replica: every admission setting at its default."""
    return harvest_api


@pytest.fixture(scope="module")
def tokenizer(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny.path)


def _longest_entry(tokenizer) -> int:
    return max(len(entry) for entry in tokenizer.get_vocab())


def _post(server: ApiServer, key: str, body, route: str = "harvest", **kwargs) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http_calls.post(f"{server.base_url}/{route}", content=content, timeout=kwargs.pop("timeout", 120),
                           headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"}, **kwargs)


def _error(response: httpx.Response, status: int, code: str, param: str | None) -> str:
    assert response.status_code == status, response.text[:2000]
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, param), error
    return error["message"]


# --- the cost, cheapest facts first -------------------------------------------------------------


def test_token_counts_equal_a_full_tokenization_cut_to_the_context(tokenizer):
    from harvest.tokenize import count_tokens

    longest = _longest_entry(tokenizer)
    prompts = ["The sky is", "Photosynthesis " * 90, "<|begin_of_text|>" * 7, "zq " * 500, "é" * 400, "a"]
    for max_len, add in ((16, True), (40, False), (2048, True)):
        full = [min(len(ids), max_len) for ids in tokenizer(prompts, add_special_tokens=add)["input_ids"]]
        # A tiny slice makes every prompt a tokenizer call of its own: the same counts.
        for slice_chars in (1, 1 << 20):
            assert count_tokens(tokenizer, prompts, add_special_tokens=add, max_len=max_len, chars_per_token=longest,
                                slice_chars=slice_chars) == full
    # Past a limit, counting stops after the slice that passed it: a prefix of the same counts.
    many = prompts * 50
    full = [len(ids) for ids in tokenizer(many)["input_ids"]]
    stopped = count_tokens(tokenizer, many, add_special_tokens=True, max_len=2048, chars_per_token=longest,
                           stop_above=1000, slice_chars=2000)
    assert sum(stopped) > 1000 and len(stopped) < len(many) and stopped == full[:len(stopped)]


def test_a_job_certainly_over_two_million_tokens_is_refused_from_its_characters(tiny, tokenizer):
    """4,000 prompts of 12,000 characters: no tokenizer runs to refuse them."""
    from harvest.cost import check_before_tokenizing
    from harvest.request import HarvestRequest, resolve_job
    from harvest.registry import load_registry

    longest = _longest_entry(tokenizer)
    job = resolve_job(HarvestRequest(model="llama-tiny", prompts=["x" * 12_000] * 4_000), load_registry(get_settings()))
    least = 4_000 * min(math.ceil(12_000 / longest) + 1, tiny.max_model_len)
    with pytest.raises(InvalidRequest) as refused:
        check_before_tokenizing(job, Lane(name="small"), chars_per_token=longest)
    assert refused.value.param == "prompts"
    assert f"at least {least:,} tokens" in refused.value.message and "at most 2,000,000" in refused.value.message

    # One prompt whose characters already fill the context, every layer: its values alone are
    # over a 1 MiB shard, whatever shard_size would be chosen.
    config = json.loads((tiny.path / "config.json").read_text())
    job = resolve_job(HarvestRequest(model="llama-tiny", prompts=["short", "y" * (longest * tiny.max_model_len)], layers="all"),
                      load_registry(get_settings()))
    with pytest.raises(InvalidRequest) as refused:
        check_before_tokenizing(job, Lane(name="xl", max_shard_bytes=SHARD_LIMIT), chars_per_token=longest)
    floor = tiny.max_model_len * (config["num_hidden_layers"] * config["hidden_size"] * 2 + 4)
    assert refused.value.param == "prompts"
    assert f"Prompt 1 alone would make a shard of at least {floor:,} bytes" in refused.value.message, refused.value.message


def _brute_largest_fitting(counts: list[int], per_token: int, limit: int, below: int) -> int:
    """Every shard_size under `below`, every shard, in plain Python (headers at their most)."""
    for size in range(below - 1, 0, -1):
        shards = [counts[i:i + size] for i in range(0, len(counts), size)]
        if all(sum(c * per_token + 256 for c in shard) + 64 <= limit for shard in shards):
            return size
    return 0


def test_an_assessing_child_counts_tokens_without_torch(tiny):
    """What a child imports is its start's cost, paid by every replica: the request, its
    checks and the built checkpoint's tokenizer need no torch and no transformers (the Rust
    tokenizers library counts: `harvest.tokenize.load_counter`), and validating the body needs
    none of the replica's web framework or SQL."""
    script = (
        "import json, sys\n"
        "from api.admission_process import assess\n"
        "from harvest.errors import validate_body\n"
        "from harvest.registry import load_registry\n"
        "from harvest.settings import get_settings\n"
        "from harvest.request import HarvestRequest\n"
        "body = json.dumps({'model': 'llama-tiny', 'prompts': ['one prompt', 'and another'], 'layers': 'all'}).encode()\n"
        "fields = assess(validate_body(HarvestRequest, body, strict=True), load_registry(get_settings()))\n"
        "print(json.dumps({'tokens': fields['reserved_tokens'], 'loaded': sorted(m for m in ('torch', 'transformers', 'fastapi', 'sqlalchemy') if m in sys.modules)}))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["loaded"] == []
    assert answer["tokens"] > 0


# Real text, and what tokenizers treat specially: empty and blank prompts, accents, emoji,
# tabs and runs of spaces, CJK, and special tokens' own spellings typed as text.
_COUNTED_TEXTS = [p for p in Path("/usr/share/common-licenses/GPL-3").read_text().split("\n\n") if p.strip()] + [
    "", " ", "héllo wörld 🤖", "\t\ttabs  and  spaces ", "日本語のテキスト", "<s> </s> <|endoftext|> <|im_start|>"]


# Every checkpoint the project builds: the embedded model, the real one, and one per family
# (each family's tokenizer has its own BOS, EOS and whether it adds one).
BUILT_CHECKPOINTS = [
    "llama-tiny", "smollm2-135m", "mistral-tiny", "qwen2-tiny", "qwen3-tiny", "qwen3-moe-tiny", "gemma2-tiny",
    "gemma3-tiny", "gpt2-tiny", "pythia-tiny", "olmo2-tiny", "phi3-tiny", "trinity-tiny",
]


@pytest.mark.parametrize("name", BUILT_CHECKPOINTS)
def test_the_counting_tokenizer_gives_the_ids_the_run_tokenizes_with(name, registry, tiny):
    """Admission counts with the Rust tokenizers library (`load_counter`); the run tokenizes with
    transformers' class (`load_tokenizer`). A key is charged what was counted, so on every
    checkpoint the project builds the two must give the same ids, with and without special
    tokens, and the same vocabulary (`max_token_chars` reads it)."""
    from harvest.tokenize import _RustTokenizer, load_counter, load_tokenizer

    # No built entry of the registry is left out of the list above.
    assert {m.name for m in registry.all() if m.build_target is not None} <= set(BUILT_CHECKPOINTS)
    path = registry.get(name).require_path()
    counter, tokenizer = load_counter(path), load_tokenizer(path)
    assert isinstance(counter, _RustTokenizer)  # a built checkpoint: not transformers' class again
    for special in (True, False):
        expected = tokenizer(_COUNTED_TEXTS, add_special_tokens=special)["input_ids"]
        assert counter(_COUNTED_TEXTS, add_special_tokens=special)["input_ids"] == expected, special
    assert counter.get_vocab() == tokenizer.get_vocab()


def _maps_torch(pid: int) -> bool:
    """Whether the process has torch's library mapped (the kernel's record, not the process's)."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_a_replica_serves_submits_without_torch_until_its_first_inline_answer(harvest_home, tiny):
    """A replica runs no engine: its start, its model list and a submit load no torch (the
    engines' names it imports name torch for typing only); its first inline answer does, the
    residual stream's tensors coming from its engine's child."""
    from tests.api_fixtures import ApiServer

    server = ApiServer(harvest_home, "no-torch", {"HARVEST_ENGINE": "hf"}).start()
    try:
        headers = {"Authorization": f"Bearer {server.make_key()}"}
        assert http_calls.get(f"{server.base_url}/models", headers=headers, timeout=60).status_code == 200
        submitted = http_calls.post(f"{server.base_url}/harvest", headers=headers, timeout=60,
                                    json={"model": "llama-tiny", "prompts": ["one prompt", "and another"]})
        assert submitted.status_code == 202, submitted.text
        assert not _maps_torch(server.process.pid)
        inline = http_calls.post(f"{server.base_url}/completions", headers=headers, timeout=120, json={
            "model": "llama-tiny", "prompt": "one prompt", "max_tokens": 1, "output_residual_stream": True})
        assert inline.status_code == 200, inline.text
        assert _maps_torch(server.process.pid)  # the check above can tell: torch shows once loaded
    finally:
        server.stop()


def test_the_largest_fitting_shard_size_is_the_largest_whose_shards_all_fit():
    from harvest.cost import largest_fitting_shard_size

    rng = np.random.default_rng(7)
    for _ in range(30):
        counts = [int(c) for c in rng.integers(1, 400, size=int(rng.integers(1, 80)))]
        per_token, below = int(rng.integers(100, 3000)), int(rng.integers(2, 100))
        limit = int(rng.integers(50_000, 3_000_000))
        assert largest_fitting_shard_size(np.array(counts), per_token, limit, below) == \
            _brute_largest_fitting(counts, per_token, limit, below)


def test_shards_over_the_lanes_max_shard_bytes_are_refused_naming_the_shard_size_that_fits(replica, tiny, tokenizer):
    key = replica.make_key(name="shards")
    prompts = [f"Prompt {i}: " + "the quick brown fox jumps over the lazy dog " * (3 + i % 5) for i in range(64)]
    counts = [len(ids) for ids in tokenizer(prompts)["input_ids"]]
    config = json.loads((tiny.path / "config.json").read_text())
    per_token = 1 * config["hidden_size"] * 2 + 4  # one layer of bf16, and an int32 id
    fits = _brute_largest_fitting(counts, per_token, SHARD_LIMIT, 64)
    assert 1 < fits < 64
    message = _error(_post(replica, key, {"model": "llama-tiny-xl", "prompts": prompts, "layers": [3], "shard_size": 64}),
                     400, "invalid_request", "shard_size")
    assert f"The largest shard_size whose shards all fit is {fits}." in message, message
    assert f"the xl lane are at most {SHARD_LIMIT:,} bytes" in message and "max_shard_bytes" in message
    accepted = _post(replica, key, {"model": "llama-tiny-xl", "prompts": prompts, "layers": [3], "shard_size": fits})
    assert accepted.status_code == 202, accepted.text
    body = accepted.json()
    assert (body["shard_size"], body["progress"]["n_shards"], body["reserved_tokens"]) == (fits, -(-64 // fits), sum(counts))


# --- the replica's budget --------------------------------------------------------------------------


def test_the_budget_holds_bytes_a_keys_share_and_working_places_then_answers_503_with_retry_after():
    from api.admission import AdmissionBudget

    async def scenario() -> dict:
        budget = AdmissionBudget(concurrency=1, max_bytes=100, key_share=1, queue=1, wait_s=0.3)
        seen: dict = {}
        async with budget.hold("a", 60):
            # The key's share is taken: a second submit of "a" waits, then is refused.
            with pytest.raises(ReplicaBusy) as waited:
                async with budget.hold("a", 1):
                    pass
            seen["key_share"] = waited.value
            # 60 + 60 is over 100 bytes: "b" waits for the bytes, then is refused.
            started = time.monotonic()
            with pytest.raises(ReplicaBusy):
                async with budget.hold("b", 60):
                    pass
            seen["bytes_wait"] = time.monotonic() - started
            async with budget.hold("b", 40):  # fits beside it
                async with budget.work():  # the one working place
                    # One more may wait for it; the next is refused at once (a queue of 1).
                    waiter = asyncio.ensure_future(budget.work().__aenter__())
                    await asyncio.sleep(0.05)
                    started = time.monotonic()
                    with pytest.raises(ReplicaBusy) as full:
                        async with budget.work():
                            pass
                    seen["queue_full_s"] = time.monotonic() - started
                    seen["queue_full"] = full.value
                    with pytest.raises(ReplicaBusy):
                        await waiter
                    seen["held"] = (budget.submits, budget.bytes, budget.working)
        async with budget.hold("e", 500):  # alone, a body over the whole budget is admitted
            seen["alone"] = (budget.submits, budget.bytes)
        seen["after"] = (budget.submits, budget.bytes, budget.working, budget.waiting)
        return seen

    seen = asyncio.run(scenario())
    for refusal in (seen["key_share"], seen["queue_full"]):
        assert (refusal.status, refusal.code) == (503, "replica_busy")
        assert int(refusal.headers["Retry-After"]) >= 1
    assert seen["bytes_wait"] >= 0.3 and seen["queue_full_s"] < 0.1
    assert seen["held"] == (2, 100, 1)
    assert seen["alone"] == (1, 500) and seen["after"] == (0, 0, 0, 0)


def test_a_body_that_does_not_arrive_in_time_is_408_and_holds_no_place():
    """A slow sender (a body trickling in, or never finished) cannot keep its bytes held."""
    from starlette.requests import Request

    from api.admission import AdmissionBudget, read_body_within
    from api.errors import RequestTimeout

    async def scenario():
        async def receive():  # the first piece, then nothing more ever arrives
            if not sent:
                sent.append(True)
                return {"type": "http.request", "body": b'{"model": ', "more_body": True}
            await asyncio.sleep(3600)

        sent: list = []
        request = Request({"type": "http", "method": "POST", "path": "/v1/harvest", "headers": [(b"content-length", b"1000")]},
                          receive)
        budget = AdmissionBudget(concurrency=1, max_bytes=10_000, key_share=1, queue=1, wait_s=1)
        started = time.monotonic()
        with pytest.raises(RequestTimeout) as late:
            async with budget.hold("slow", 1000):
                await read_body_within(request, 0.3)
        return late.value, time.monotonic() - started, (budget.submits, budget.bytes)

    error, took, after = asyncio.run(scenario())
    assert (error.status, error.code) == (408, "request_timeout") and "0.3 seconds" in error.message
    assert 0.3 <= took < 2 and after == (0, 0)


def _rss(pid: int) -> int:
    """The replica's RSS and its assessing children's (where its submits are parsed)."""
    return sum(process.memory_info().rss for process in [psutil.Process(pid), *_assessors(pid)])


def test_six_concurrent_48_mb_bodies_stay_within_the_replicas_bound_and_another_key_is_served(replica):
    """The shape that took a replica from 0.7 GB to 8.9 GB: 6 × 4,000 prompts of 12,000
    characters from one key, each over 2,000,000 tokens. Bound: the admission budget's
    bodies (128 MiB) a few times over; here `4 × admission_bytes` above the idle replica and its
    assessing children together (the replica holds bodies within `admission_bytes`; each child
    one body, its parsed prompts and their parser's working memory, about 3 × a body)."""
    attacker, neighbour = replica.make_key(name="flood", small=50), replica.make_key(name="neighbour", small=50)
    small = {"model": "llama-tiny", "prompts": ["The sky is"], "layers": [1]}
    assert _post(replica, neighbour, small).status_code == 202  # tokenizer and routes warm
    pid = replica.process.pid
    idle = _rss(pid)
    body = json.dumps({"model": "llama-tiny", "prompts": [("lorem ipsum dolor sit amet " * 445)[:12_000]] * 4_000}).encode()
    assert 47_000_000 < len(body) < 50 * 1024 * 1024

    peak, stop = [idle], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss(pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        with ThreadPoolExecutor(6) as pool:
            flood = [pool.submit(_post, replica, attacker, body, timeout=300) for _ in range(6)]
            time.sleep(1.0)
            started = time.monotonic()
            served = _post(replica, neighbour, small, timeout=60)
            neighbour_s = time.monotonic() - started
            pending_meanwhile = sum(not f.done() for f in flood)
            answers = [f.result() for f in flood]
    finally:
        stop.set()
        sampler.join()
    budget = 128 << 20
    assert served.status_code == 202, served.text
    assert pending_meanwhile >= 1 and neighbour_s < 15, (pending_meanwhile, neighbour_s)
    for answer in answers:
        if answer.status_code == 503:  # waited its turn past admission_wait_s: told when to come back
            assert answer.json()["error"]["code"] == "replica_busy" and answer.headers["Retry-After"]
        else:
            message = _error(answer, 400, "invalid_request", "prompts")
            assert "at most 2,000,000" in message and "at least" in message  # refused before tokenizing
    assert sum(a.status_code == 400 for a in answers) >= 1
    grown = peak[0] - idle
    print(f"replica RSS idle {idle / 2**20:.0f} MiB, peak {peak[0] / 2**20:.0f} MiB (+{grown / 2**20:.0f} MiB); "
          f"neighbour served in {neighbour_s:.2f} s with {pending_meanwhile} flood requests pending")
    assert grown < 4 * budget, f"the replica and its assessing children grew by {grown / 2**20:.0f} MiB"


def _assessors(replica_pid: int) -> list[psutil.Process]:
    """The replica's running assessing children (`api.admission_process`), from the process table."""
    found = []
    for child in psutil.Process(replica_pid).children():
        try:
            if "api.admission_process" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:  # ended, or dead and not yet reaped
            pass
    return found


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _cpu_s(pid: int) -> float:
    return sum(cpu for _, cpu in thread_stats(pid).values())


def test_a_submits_tokens_are_counted_outside_the_replicas_session_at_the_admission_nice(replica):
    """A body the characters cannot refuse (4,000 prompts of 3,000 characters: at least
    705,883 tokens by its characters, about 2.4 million counted) is counted to the limit, then
    refused. The kernel's account shows where that CPU went: in one of the replica's assessing
    children, on one thread, in a session of its own whose scheduling group is at `WORK_NICE`
    (a session's share of a contended CPU ignores its threads' nice, so counting on the
    replica's threads took the share its reads needed); the replica's own CPU stays small."""
    from api.admission import WORK_NICE

    key = replica.make_key(name="nice-count", small=50)
    rng = np.random.default_rng(7)
    words = ["lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit", "sed", "do"]
    prompts = [" ".join(rng.choice(words, 600))[:3_000] for _ in range(4_000)]
    pid = replica.process.pid
    deadline = time.monotonic() + 60
    while len(children := _assessors(pid)) < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert children, "the replica started no assessing child"
    before = {child.pid: thread_stats(child.pid) for child in children}
    replica_before = _cpu_s(pid)
    message = _error(_post(replica, key, {"model": "llama-tiny", "prompts": prompts}), 400, "invalid_request", "prompts")
    replica_spent = _cpu_s(pid) - replica_before
    assert "at most 2,000,000" in message and "at least" not in message  # counted, not refused from characters
    spent = {(child, tid): cpu - before.get(child, {}).get(tid, (0, 0.0))[1]
             for child in before for tid, (_, cpu) in thread_stats(child).items()}
    (counter, busiest), most = max(spent.items(), key=lambda item: item[1])
    total = sum(cpu for (child, _), cpu in spent.items() if child == counter)
    group_nice = autogroup_nice(counter)  # "/autogroup-1234 nice 10"; None on a kernel without autogroups
    print(f"assessing child {counter}: {total:.2f} CPU s, its busiest thread {most:.2f} s; group nice {group_nice}; "
          f"the replica {replica_spent:.2f} CPU s")
    assert most > 0.5 and most > 0.75 * total, spent  # on one thread: no tokenizer pool
    assert os.getsid(counter) != os.getsid(pid) and os.getsid(counter) == counter
    assert group_nice in (WORK_NICE, None)  # without autogroups, the fallback: the threads' own nice
    assert {nice for nice, _ in thread_stats(counter).values()} == {WORK_NICE}
    assert replica_spent < 0.25 * most, (replica_spent, most)


def test_the_replica_asks_for_the_shortest_slice_and_its_assessing_children_go_back_to_the_default(replica):
    """A read wakes the replica several times, and each wake-up waits for the running task's
    slice unless its own is shorter (EEVDF): every thread of the replica runs with the
    kernel's shortest slice, read back from /proc; its assessing children, started by it and
    so inheriting it, are bulk work and go back to the kernel's default."""
    from api.responsiveness import RESPONSIVE_SLICE_NS

    pid = replica.process.pid
    if not slices_supported():  # before Linux 6.12 the slice is ignored (the fallback): the replica still serves
        assert http_calls.get(f"{replica.root}/health", timeout=60).status_code == 200
        return
    default = thread_slices(os.getpid())[threading.get_native_id()]  # this test's own thread: the kernel's default
    deadline = time.monotonic() + 60
    while len(children := _assessors(pid)) < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert children, "the replica started no assessing child"
    assert default > RESPONSIVE_SLICE_NS
    assert set(thread_slices(pid).values()) == {RESPONSIVE_SLICE_NS}
    for child in children:  # a child lowers itself once it has started, before it serves
        while (slices := set(thread_slices(child.pid).values())) != {default} and time.monotonic() < deadline:
            time.sleep(0.2)
        assert slices == {default}, child.pid


# --- integers, and malformed input without a key -----------------------------------------------------


def test_integers_written_with_a_zero_fraction_are_integers_and_fractions_are_refused(replica):
    key = replica.make_key(name="integers", small=50)
    accepted = _post(replica, key, {"model": "llama-tiny", "prompts": ["The sky is"], "layers": [1.0, 3.0],
                                    "shard_size": 2.0, "batch_size": 514.0})
    assert accepted.status_code == 202, accepted.text
    assert (accepted.json()["layers"], accepted.json()["shard_size"]) == ([1, 3], 2)
    for field, value in (("batch_size", 514.5), ("shard_size", 2.5), ("batch_size", "514"), ("batch_size", True)):
        _error(_post(replica, key, {"model": "llama-tiny", "prompts": ["a"], field: value}), 400, "invalid_request", field)
    _error(_post(replica, key, {"model": "llama-tiny", "prompts": ["a"], "layers": [1.5]}), 400, "invalid_request", "layers")

    completion = _post(replica, key, {"model": "llama-tiny", "prompt": "The sky is", "max_tokens": 2.0, "seed": 3.0,
                                      "temperature": 0, "output_residual_stream": [1.0]}, route="completions")
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["completion_tokens"] == 2
    assert completion.json()["activations"]["residual_stream"]["layers"] == [1]
    _error(_post(replica, key, {"model": "llama-tiny", "prompt": "a", "max_tokens": 2.5}, route="completions"),
           400, "invalid_request", "max_tokens")


def test_malformed_input_on_routes_without_a_key_is_4xx_never_500(replica):
    job = "0b7c2a9e-5a8e-4a3e-9a51-0d6f1f1d2c3b"
    for query in ("expires=1&signature=%C3%A9", "expires=%C2%B2&signature=abc", "expires=%D9%A3&signature=" + "0" * 64,
                  "expires=1&signature=" + "é" * 64, "expires=99999999999999999999999&signature=" + "0" * 64):
        response = http_calls.get(f"{replica.base_url}/files/{job}/manifest.json?{query}", timeout=30)
        assert response.status_code == 403, (query, response.text)
        assert response.json()["error"]["code"] == "link_invalid"
    key = replica.make_key(name="nested", small=50)
    for route in ("completions", "harvest"):
        _error(_post(replica, key, b"[" * 100_000, route=route), 400, "invalid_request", None)


def test_an_assessing_child_that_dies_costs_one_submit_a_503_and_is_started_again(replica):
    """SIGKILL of the child counting a submit (a body the characters cannot refuse, ~1 s to
    count): that submit is answered 503 `replica_busy` with Retry-After, nothing is admitted
    for it (the key's job list, read back, is empty); the next submit gets a new child and 202.
    A child killed while idle is replaced before the next submit without any error."""
    import signal

    key = replica.make_key(name="killed-child", small=50)
    ok = {"model": "llama-tiny", "prompts": ["The sky is"], "layers": [1]}
    assert _post(replica, key, ok).status_code == 202  # the children are up
    pid = replica.process.pid
    rng = np.random.default_rng(11)
    words = ["lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit", "sed", "do"]
    heavy = {"model": "llama-tiny", "prompts": [" ".join(rng.choice(words, 600))[:3_000] for _ in range(4_000)]}
    before = {child.pid: child.cpu_times().user for child in _assessors(pid)}
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(_post, replica, key, heavy)
        deadline, counting = time.monotonic() + 30, None
        while counting is None and time.monotonic() < deadline:  # the child whose CPU moves
            time.sleep(0.1)
            counting = next((child for child in _assessors(pid)
                             if child.cpu_times().user - before.get(child.pid, 0.0) > 0.2), None)
        assert counting is not None, "no child counted the submit"
        counting.send_signal(signal.SIGKILL)
        refused = answer.result()
    _error(refused, 503, "replica_busy", None)
    assert int(refused.headers["Retry-After"]) >= 1
    jobs = http_calls.get(f"{replica.base_url}/harvest", headers={"Authorization": f"Bearer {key}"}).json()["data"]
    assert len(jobs) == 1  # the first small job only: nothing admitted for the killed submit
    assert _post(replica, key, ok).status_code == 202
    idle = _assessors(pid)
    for child in idle:  # killed while idle: replaced on the next submit, no error
        child.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_running(child) for child in idle):
        time.sleep(0.05)  # dead; the replica reaps them when it next looks
    assert _post(replica, key, ok).status_code == 202
    assert counting.pid not in {child.pid for child in _assessors(pid)}
