"""Data of the local lm_eval tasks in this folder, read from the jsonl files beside it (so the tasks
work from any working directory, offline)."""

import json
import os

import datasets

HERE = os.path.dirname(os.path.abspath(__file__))


def _split(name):
  with open(os.path.join(HERE, name), encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def choice_docs(**kwargs):
  return _split("choice.jsonl")


def document_docs(**kwargs):
  return _split("documents.jsonl")


def generate_docs(**kwargs):
  return _split("generate.jsonl")
