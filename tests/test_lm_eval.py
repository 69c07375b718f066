"""lm-evaluation-harness, as people run it against an OpenAI-compatible server: its `local-completions` model drives
`specdec serve` through a loglikelihood task (multiple choice: prompts scored with echo and logprobs) and a
generate-until task (greedy completions with stop strings), and scores what target-only serving scores.

The two tasks are defined here, on generated text, so that the test runs offline."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_serve import KEY, Server, folder  # noqa: F401 - the same tiny chat model folder

pytest.importorskip("lm_eval")

SPECULATING = ("--draft", "prompt-lookup", "--k", "4", "--k-policy", "fixed", "--k-cap", "fixed")
WORDS = "red blue green cat dog sun moon tree bird fish stone river".split()


def _choice_docs(rng: random.Random, count: int) -> list[dict]:
    """Continue a counting or repeating pattern: four choices, one the pattern's next item."""
    docs = []
    for _ in range(count):
        if rng.random() < 0.5:
            start, step = rng.randrange(1, 40), rng.randrange(1, 4)
            items = [str(start + i * step) for i in range(5)]
            right = str(start + 5 * step)
            wrong = rng.sample([str(start + 5 * step + d) for d in (-2, -1, 1, 2, 3)], 3)
        else:
            cycle = rng.sample(WORDS, 3)
            items = [cycle[i % 3] for i in range(5)]
            right = cycle[5 % 3]
            wrong = rng.sample([w for w in WORDS if w != right], 3)
        choices = [right, *wrong]
        rng.shuffle(choices)
        docs.append({"context": " ".join(items), "choices": [f" {c}" for c in choices], "label": choices.index(right)})
    return docs


def _generation_docs(rng: random.Random, count: int) -> list[dict]:
    """Repeat a phrase: repetitive prompts, so that prompt lookup drafts and the target accepts some."""
    docs = []
    for _ in range(count):
        phrase = " ".join(rng.sample(WORDS, rng.randrange(2, 4)))
        docs.append({"prompt": f"{phrase}. {phrase}. {phrase}.", "answer": f" {phrase}."})
    return docs


def _tasks(folder: Path) -> Path:  # noqa: F811 - a path, not the fixture
    """Two task YAMLs over generated JSONL files in ``folder``: the --include_path to pass."""
    rng = random.Random(0)
    for name, docs in [("choice", _choice_docs(rng, 30)), ("repeat", _generation_docs(rng, 24))]:
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    common = {"dataset_path": "json", "test_split": "test", "metadata": {"version": 1}}
    choice = {
        "task": "specdec_choice",
        "dataset_kwargs": {"data_files": {"test": str(folder / "choice.jsonl")}},
        "output_type": "multiple_choice",
        "doc_to_text": "{{context}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{label}}",
        "target_delimiter": "",
        "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}],
    }
    repeat = {
        "task": "specdec_repeat",
        "dataset_kwargs": {"data_files": {"test": str(folder / "repeat.jsonl")}},
        "output_type": "generate_until",
        "doc_to_text": "{{prompt}}",
        "doc_to_target": "{{answer}}",
        "target_delimiter": "",
        "generation_kwargs": {"until": ["\n"], "max_gen_toks": 24, "do_sample": False},
        "metric_list": [{"metric": "exact_match"}, {"metric": "chrf"}],
    }
    for task in (choice, repeat):
        (folder / f"{task['task']}.yaml").write_text(yaml.safe_dump({**common, **task}))
    return folder


def _evaluate(server: Server, model_folder: Path, tasks: Path, out: Path) -> tuple[dict, dict]:
    """Run the harness's CLI against ``server``: each task's metrics, and each document's responses."""
    model = server.client.models.list().data[0].id
    model_args = (
        f"model={model},base_url={server.url}/v1/completions,tokenizer={model_folder},tokenizer_backend=huggingface,"
        "num_concurrent=1,max_retries=1,max_length=256"
    )
    hub = out / "hf"  # offline: the harness's datasets come from the JSONL files, their cache here
    env = {**os.environ, "OPENAI_API_KEY": KEY, "HF_HOME": str(hub), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", model_args]
    command += ["--tasks", "specdec_choice,specdec_repeat", "--include_path", str(tasks)]
    command += ["--output_path", str(out / "results"), "--log_samples", "--seed", "0"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    (results,) = (out / "results").rglob("results_*.json")
    scores = {
        task: {name: value for name, value in metrics.items() if name != "alias"}
        for task, metrics in json.loads(results.read_text())["results"].items()
    }
    responses = {}
    for samples in (out / "results").rglob("samples_*.jsonl"):
        task = samples.name.removeprefix("samples_").rsplit("_", 1)[0]
        rows = sorted(map(json.loads, samples.read_text().splitlines()), key=lambda row: row["doc_id"])
        responses[task] = [row["resps"] for row in rows]
    return scores, responses


PROBE = "moon red dog moon red dog"


def _probe(server: Server) -> list[float]:
    """The logprobs of a fixed prompt's tokens as the server scores it: echo, logprobs 1, max_tokens 1, temperature 0,
    like the harness's loglikelihood requests (as text, not token ids)."""
    model = server.client.models.list().data[0].id
    answer = server.client.completions.create(
        model=model, prompt=PROBE, max_tokens=1, echo=True, logprobs=1, temperature=0
    )
    return answer.choices[0].logprobs.token_logprobs[1:]


@pytest.mark.slow
def test_lm_eval_harness_scores_what_target_only_serving_scores(folder: Path, tmp_path: Path) -> None:  # noqa: F811
    """Both tasks run to completion against the speculating server, and their scores and every document's
    responses (loglikelihoods, greedy completions) equal those against the same server with --draft none. A probe
    prompt scored before and after each run shows whether a difference is the server's state or its start."""
    tasks = _tasks(tmp_path)
    got, probes, runtimes = {}, {}, {}
    for name, args in [("speculating", SPECULATING), ("target-only", ("--draft", "none"))]:
        server = Server(str(folder), *args, key=KEY)
        try:
            before = _probe(server)
            got[name] = _evaluate(server, folder, tasks, tmp_path / name)
            probes[name] = (before, _probe(server))
            if name == "speculating":  # the generate-until task ran speculation: drafts judged, some accepted
                assert server.metric("specdec_draft_tokens_accepted_total") > 0
            assert server.metric("specdec_requests_total", endpoint="/v1/completions", status="400") == 0
        finally:
            _, log = server.stop()
            runtimes[name] = [line for line in log.splitlines() if "runtime: " in line]
    said = f"runtimes: {runtimes}; probe scores (before, after): {probes}"
    assert all(before == after for before, after in probes.values()), f"a server's scores changed as it ran: {said}"
    assert probes["speculating"] == probes["target-only"], f"the two servers score differently from the start: {said}"
    (scores, responses), (expected_scores, expected_responses) = got["speculating"], got["target-only"]
    assert set(scores) == {"specdec_choice", "specdec_repeat"}
    assert len(responses["specdec_choice"]) == 30 and len(responses["specdec_repeat"]) == 24
    assert responses == expected_responses, said
    assert scores == expected_scores, said
    print(json.dumps(scores, indent=1))
