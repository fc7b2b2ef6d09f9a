"""GSM8K (Cobbe et al. 2021, github.com/openai/grade-school-math, MIT) on disk: a local copy read line by line, each
mistake one line naming the file, the line and what to do; else downloaded once into the cache ($GRPO_CACHE, default
~/.cache/grpo-mini) and checked by sha256. Imported only by a task that uses it (tasks.load_gsm8k)."""

import hashlib
import json
import os
import tempfile
import urllib.request
from pathlib import Path

from config import DataError

GSM8K_URL = "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/{split}.jsonl"
GSM8K_SHA256 = {
    "train": "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465",
    "test": "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14",
}


def extract_gold(solution_text):
    """Gold answer of a GSM8K solution: the text after the last `####`, commas stripped ("#### 1,005" -> "1005")."""
    gold = solution_text.rsplit("####", 1)[1].strip().replace(",", "") if "####" in solution_text else None
    if not gold:
        what = "no '#### <answer>' line" if gold is None else "nothing after '####'"
        raise ValueError(f"{what} in solution: {solution_text[-80:]!r}")
    return gold


def download(split, path):
    """GSM8K's `split` downloaded to `path` (a Path), once its sha256 checks out -> None, or why it could not be."""
    url = GSM8K_URL.format(split=split)
    try:
        with urllib.request.urlopen(url, timeout=20) as r:
            data = r.read()
    except OSError as e:  # URLError, timeouts, refused connections are all OSErrors
        return f"could not download GSM8K from {url} ({e})"
    if (got := hashlib.sha256(data).hexdigest()) != GSM8K_SHA256[split]:
        return f"downloaded {url} has sha256 {got}, expected {GSM8K_SHA256[split]}"
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".part", delete=False) as f:
        f.write(data)
    os.replace(f.name, path)  # atomic: a reader never sees half a file
    return None


GSM8K_HINT = "pass --data-dir DIR or set GSM8K_DIR=DIR to a directory holding train.jsonl and test.jsonl"


def load(split, data_dir=None):
    """GSM8K examples {"question", "answer" (gold number), "solution"} from data_dir, else $GSM8K_DIR (read as
    is: an edited copy works), else the cache (downloaded on first use, checked by sha256)."""
    if split not in ("train", "test"):
        raise ValueError(f"unknown split {split!r}; valid splits: ['train', 'test']")
    data_dir = data_dir or os.environ.get("GSM8K_DIR")
    cache = Path(os.environ.get("GRPO_CACHE") or "~/.cache/grpo-mini").expanduser() / "gsm8k"
    path = (Path(data_dir).expanduser() if data_dir else cache) / f"{split}.jsonl"
    if data_dir and not path.is_file():
        raise DataError(f"GSM8K file not found: {path}; {GSM8K_HINT}")
    if not path.is_file() and (problem := download(split, path)):
        raise DataError(f"{problem}; {GSM8K_HINT}")
    examples = []
    for lineno, raw in enumerate(path.read_bytes().split(b"\n"), 1):  # bytes: a bad byte is reported with its line
        try:
            if (line := raw.decode("utf-8-sig")).strip():  # -sig: a file saved with a BOM reads the same
                row = json.loads(line)
                question, solution = row["question"], row["answer"]
                if not isinstance(question, str) or not question.strip():
                    raise ValueError(f"'question' must be a non-empty string, got {question!r:.40}")
                examples.append({"question": question, "answer": extract_gold(solution), "solution": solution})
        except UnicodeDecodeError as e:
            raise DataError(f"{path}:{lineno}: byte {raw[e.start]:#04x} is not UTF-8; save the file as UTF-8") from None
        except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError too
            why = f"{type(e).__name__}: {e}"  # a KeyError, a TypeError
            if isinstance(e, ValueError):
                why = str(e)
            if isinstance(e, json.JSONDecodeError):
                why = f"not valid JSON ({e.msg})"
            raise DataError(f"{path}:{lineno}: {why}; expected an object with 'question' and 'answer'") from None
    if not examples:
        raise DataError(f"no examples in {path}; {GSM8K_HINT}")
    return examples
