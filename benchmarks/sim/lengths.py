"""Response-length distributions of the simulator: log-normal with a per-prompt share, or past lengths.

``Lengths.natural(prompt_key, sample_key)`` is the length a response would reach at its EOS; it
is a pure function of the keys and the seed, so a request stopped and continued after a weight
update still ends where it would have. Spec strings (``Lengths.parse``):

* ``lognormal:median=M,sigma=S,cap=C[,prompt=R]``: :math:`L = \\min(C, \\max(1,
  \\operatorname{round}(M e^{S(\\sqrt{R} Z_p + \\sqrt{1-R} Z_s)})))`, :math:`Z_p` per prompt,
  :math:`Z_s` per sample: ``R`` is the share of the log-variance that belongs to the prompt
  (0: W1, lengths independent of the prompt; RollPacker's data, where long prompts stay long,
  is closer to 0.5).
* a JSONL file (``--lengths-file``): one record per line, ``{"length": 123}`` or a bare number;
  samples are drawn from it with replacement.

>>> d = Lengths.parse("lognormal:median=100,sigma=1,cap=4000")
>>> d.natural(3, 7) == d.natural(3, 7), 1 <= d.natural(3, 8) <= 4000
(True, True)
"""

from __future__ import annotations

import json
import math
import random
import zlib
from pathlib import Path

__all__ = ["Lengths"]


def _key(*parts: object) -> int:
    return zlib.crc32(repr(parts).encode())


class Lengths:
    """Natural response lengths (module docstring)."""

    def __init__(
        self,
        median: float = 16.0,
        sigma: float = 1.5,
        cap: int = 512,
        *,
        prompt_share: float = 0.0,
        samples: list[int] | None = None,
        seed: int = 0,
    ) -> None:
        if not (math.isfinite(median) and median >= 1):
            raise ValueError(f"median: must be a number >= 1, got {median!r}")
        if not (math.isfinite(sigma) and sigma >= 0):
            raise ValueError(f"sigma: must be a number >= 0, got {sigma!r}")
        if not isinstance(cap, int) or cap < 1:
            raise ValueError(f"cap: must be an int >= 1, got {cap!r}")
        if not 0 <= prompt_share <= 1:
            raise ValueError(f"prompt: the prompt share must be in [0, 1], got {prompt_share!r}")
        if samples is not None and (not samples or min(samples) < 1):
            raise ValueError("lengths file: needs at least one length, every length >= 1")
        self.median, self.sigma, self.cap, self.prompt_share = median, sigma, cap, prompt_share
        self.samples, self.seed = samples, seed

    @classmethod
    def parse(cls, spec: str, *, seed: int = 0) -> Lengths:
        """``lognormal:median=..,sigma=..,cap=..[,prompt=..]`` (module docstring)."""
        kind, _, rest = spec.partition(":")
        if kind != "lognormal":
            raise ValueError(f"--lengths: expected 'lognormal:median=M,sigma=S,cap=C', got {spec!r}")
        names = {"median": "median", "sigma": "sigma", "cap": "cap", "prompt": "prompt_share"}
        kw: dict[str, float] = {}
        for item in filter(None, rest.split(",")):
            k, eq, v = item.partition("=")
            if not eq or k.strip() not in names:
                raise ValueError(f"--lengths: unknown or malformed entry {item!r} (keys: {', '.join(names)})")
            try:
                kw[names[k.strip()]] = float(v)
            except ValueError:
                raise ValueError(f"--lengths: {k.strip()} must be a number, got {v!r}") from None
        if "cap" in kw:
            if kw["cap"] != int(kw["cap"]):
                raise ValueError(f"--lengths: cap must be an integer, got {kw['cap']!r}")
            kw["cap"] = int(kw["cap"])
        return cls(**kw, seed=seed)  # type: ignore[arg-type]

    @classmethod
    def from_file(cls, path: str | Path, *, cap: int | None = None, seed: int = 0) -> Lengths:
        """Past response lengths from a JSONL file (module docstring)."""
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"--lengths-file: no such file {str(p)!r}")
        out: list[int] = []
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                v = rec["length"] if isinstance(rec, dict) else rec
                n = int(v)
                if n != v or n < 1:
                    raise ValueError
            except (ValueError, KeyError, TypeError):
                raise ValueError(
                    f'--lengths-file: line {i} is not a length >= 1 (a number or {{"length": n}}): {line[:60]!r}'
                ) from None
            out.append(n)
        if not out:
            raise ValueError(f"--lengths-file: {str(p)!r} holds no lengths")
        cap = cap or max(out)
        return cls(median=max(1.0, sorted(out)[len(out) // 2]), sigma=0.0, cap=cap, samples=out, seed=seed)

    def natural(self, prompt_key: object, sample_key: object) -> int:
        """The length of sample ``sample_key`` of prompt ``prompt_key`` at its EOS."""
        rs = random.Random(_key(self.seed, prompt_key, sample_key))
        if self.samples is not None:
            return min(self.cap, self.samples[rs.randrange(len(self.samples))])
        zp = (
            random.Random(_key(self.seed, "prompt", prompt_key)).gauss(0.0, 1.0) if self.prompt_share else 0.0
        )
        z = math.sqrt(self.prompt_share) * zp + math.sqrt(1 - self.prompt_share) * rs.gauss(0.0, 1.0)
        return max(1, min(self.cap, round(self.median * math.exp(self.sigma * z))))

    def describe(self) -> str:
        if self.samples is not None:
            return f"{len(self.samples)} past lengths (median {self.median:g}, cap {self.cap})"
        share = f", prompt share {self.prompt_share:g}" if self.prompt_share else ""
        return f"lognormal median {self.median:g}, sigma {self.sigma:g}, cap {self.cap}{share}"
