"""trainers.envs: the built-in text environments, the registry, the GEM adapter and the glue
from text episodes to rollkit trajectories."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from collections import deque

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollkit.trajectory import build_trajectory
from trainers.envs.base import Env, extract_boxed, parse_direction, stable_state_id
from trainers.envs.calculator import CalcError, CalculatorEnv, parse_tool_calls, safe_eval
from trainers.envs.frozenlake import FrozenLakeEnv
from trainers.envs.registry import ENVS, list_envs, make_env, register_env
from trainers.envs.sokoban import SokobanEnv

MOVES = ("up", "down", "left", "right")


def _rollout(env: Env, seed: int, actions: list[str]) -> list:
    out = [env.reset(seed=seed)[0]]
    for a in actions:
        step = env.step(a)
        out.append(step[:4])
        if step[2] or step[3]:
            break
    return out


def _bfs_solve(env: Env, max_depth: int) -> list[str] | None:
    """Shortest action sequence to a reward-1 termination, searched over copies of ``env``."""
    todo = deque([(env, [])])
    seen = {env.state_key()}
    while todo:
        e, path = todo.popleft()
        if len(path) >= max_depth:
            continue
        for m in MOVES:
            e2 = copy.deepcopy(e)
            _, reward, terminated, truncated, _ = e2.step(rf"\boxed{{{m}}}")
            if terminated and reward >= 1.0:
                return [*path, m]
            if terminated or truncated or e2.state_key() in seen:
                continue
            seen.add(e2.state_key())
            todo.append((e2, [*path, m]))
    return None


# ----------------------------------------------------------------------------- parsing


def test_action_parsing_follows_gem_boxed_and_accepts_bare_words():
    assert extract_boxed(r"\boxed{a} then \boxed{b{c}}") == "b{c}"
    assert extract_boxed(r"\boxed{unclosed") is None
    assert parse_direction(r"hmm \boxed{ RIGHT }") == "right"
    assert parse_direction(r"\boxed{left} no wait \boxed{down}") == "down"
    assert parse_direction("go up, then left") == "left"
    assert parse_direction(r"\boxed{upward}") is None  # a boxed answer must be a direction
    assert parse_direction("upstairs") is None and parse_direction("") is None


# ----------------------------------------------------------------------------- FrozenLake


@pytest.mark.parametrize("name", ["frozenlake", "sokoban", "calculator"])
def test_builtin_envs_are_deterministic_given_the_seed(name):
    a, b = make_env(name), make_env(name)
    rng_actions = [rf"\boxed{{{MOVES[(i * 7) % 4]}}}" for i in range(8)]
    if name == "calculator":
        rng_actions = ["<tool>calc: 2*3</tool>", r"\boxed{1}"]
    for seed in (0, 1, 17):
        assert _rollout(a, seed, rng_actions) == _rollout(b, seed, rng_actions)
        b.reset(seed=seed + 100)  # history does not leak into the next reset
        assert a.reset(seed=seed)[0] == b.reset(seed=seed)[0]
        assert a.state_key() == b.state_key()
    assert len({make_env(name).reset(seed=s)[0] for s in range(8)}) > 1


def test_frozenlake_rewards_and_termination():
    env = FrozenLakeEnv(size=3, hole_prob=0.0)
    obs, _ = env.reset(seed=0)
    assert "P F F\nF F F\nF F G" in obs and r"\boxed{" in obs
    obs, r, term, trunc, _ = env.step(r"\boxed{up}")  # off the edge: stays, explained
    assert (r, term, trunc) == (0.0, False, False) and "cannot move up" in obs and env.pos == (0, 0)
    for m in ("down", "down", "right"):
        assert env.step(m)[1:4] == (0.0, False, False)
    obs, r, term, trunc, _ = env.step(r"\boxed{right}")
    assert (r, term, trunc) == (1.0, True, False) and "reached the goal" in obs
    with pytest.raises(RuntimeError, match="reset"):
        env.step("up")


def test_frozenlake_hole_format_error_and_max_turns():
    env = FrozenLakeEnv(size=4, hole_prob=0.3)
    for seed in range(50):
        env.reset(seed=seed)
        holes = [(r, c) for r, row in enumerate(env.desc) for c, ch in enumerate(row) if ch == "H"]
        if (0, 1) in holes:
            break
    else:
        pytest.fail("no map with a hole right of the start in 50 seeds")
    obs, r, term, trunc, _ = env.step("right")
    assert (r, term, trunc) == (0.0, True, False) and "hole" in obs

    env.reset(seed=0)
    obs, r, term, trunc, info = env.step("I will jump")
    assert (r, term, trunc) == (-0.1, True, False) and "not valid" in obs and info["parsed_action"] is None

    lenient = FrozenLakeEnv(size=4, max_turns=2, end_on_format_error=False)
    lenient.reset(seed=0)
    assert lenient.step("jump")[1:4] == (-0.1, False, False)
    assert lenient.step("jump")[1:4] == (-0.1, False, True)  # out of turns: truncated

    env = FrozenLakeEnv(size=3, hole_prob=0.0, max_turns=2)
    env.reset(seed=0)
    env.step("up")
    obs, r, term, trunc, _ = env.step("up")
    assert (term, trunc) == (False, True) and "out of moves" in obs


def test_frozenlake_maps_are_solvable_and_state_keys_repeat():
    for seed in range(20):
        env = FrozenLakeEnv(size=4, hole_prob=0.3)
        env.reset(seed=seed)
        path = _bfs_solve(env, max_depth=16)
        assert path is not None, f"seed {seed} unsolvable"
    env = FrozenLakeEnv(size=3, hole_prob=0.0)
    env.reset(seed=0)
    start = env.state_key()
    env.step("right")
    assert env.state_key() != start
    env.step("left")
    assert env.state_key() == start  # the same state again: one GiGPO anchor


def test_frozenlake_slippery_is_deterministic_per_seed():
    a, b = (
        FrozenLakeEnv(size=5, hole_prob=0.0, slippery=0.5),
        FrozenLakeEnv(size=5, hole_prob=0.0, slippery=0.5),
    )
    acts = ["down", "right"] * 4
    assert _rollout(a, 3, acts) == _rollout(b, 3, acts)
    slips = 0
    for seed in range(10):
        a.reset(seed=seed)
        slips += sum("slipped_to" in a.step(m)[4] for m in ("down", "right"))
    assert slips > 0


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"size": 1}, "size"),
        ({"hole_prob": 1.0}, "hole_prob"),
        ({"max_turns": 0}, "max_turns"),
        ({"slippery": 2}, "slippery"),
    ],
)
def test_frozenlake_validates(kw, match):
    with pytest.raises(ValueError, match=match):
        FrozenLakeEnv(**kw)
    with pytest.raises(ValueError, match="seed"):
        FrozenLakeEnv().reset(seed=-1)
    env = FrozenLakeEnv()
    env.reset(seed=0)
    with pytest.raises(TypeError, match="action"):
        env.step(3)


# ----------------------------------------------------------------------------- Sokoban


@pytest.mark.parametrize(("dims", "boxes", "seeds"), [((6, 6), 1, 10), ((6, 6), 2, 6), ((7, 7), 2, 2)])
def test_sokoban_levels_are_solvable_and_start_unsolved(dims, boxes, seeds):
    for seed in range(seeds):
        env = SokobanEnv(dim_room=dims, num_boxes=boxes, max_turns=200)
        env.reset(seed=seed)
        assert env.boxes_on_targets() == 0 and len(env.boxes) == len(env.targets) == boxes
        assert env.player in env.floor and env.boxes <= env.floor and env.player not in env.boxes
        assert _bfs_solve(env, max_depth=60) is not None, f"{dims} {boxes} seed {seed} unsolvable"


def test_sokoban_push_rules_shaping_and_errors():
    env = SokobanEnv(dim_room=(6, 6), num_boxes=1)
    env.reset(seed=3)  # player (4, 4) below a box (3, 4) below the target (1, 4)
    obs, r, term, trunc, _ = env.step("left")
    assert (r, term) == (0.0, False) and "wall" in obs
    obs, r, term, trunc, _ = env.step(r"\boxed{up}")
    assert (r, term) == (0.0, False) and "pushed a box up" in obs and "X" in obs
    obs, r, term, trunc, _ = env.step("up")
    assert (r, term, trunc) == (1.0, True, False) and "solved" in obs and "*" in obs

    shaped = SokobanEnv(dim_room=(6, 6), num_boxes=1, shaping=0.1)
    shaped.reset(seed=3)
    shaped.step("up")
    assert shaped.step("up")[1] == pytest.approx(1.1)  # +0.1 onto the target, +1 solved

    env.reset(seed=3)
    obs, r, term, trunc, _ = env.step("nothing")
    assert (r, term) == (-0.1, True) and "not valid" in obs

    env = SokobanEnv(dim_room=(6, 6), num_boxes=1, max_turns=1)
    env.reset(seed=3)
    assert env.step("left")[2:4] == (False, True)
    with pytest.raises(ValueError, match="dim_room"):
        SokobanEnv(dim_room=(3, 6))
    with pytest.raises(ValueError, match="num_boxes"):
        SokobanEnv(num_boxes=0)


# ----------------------------------------------------------------------------- calculator


_ops = st.sampled_from(["+", "-", "*"])


@st.composite
def arithmetic(draw, depth: int = 0):
    """``(text, value)`` of a random expression (integers, + - *, parentheses)."""
    if depth >= 3 or draw(st.booleans()):
        v = draw(st.integers(0, 999))
        return str(v), v
    a, va = draw(arithmetic(depth + 1))
    b, vb = draw(arithmetic(depth + 1))
    op = draw(_ops)
    value = {"+": va + vb, "-": va - vb, "*": va * vb}[op]
    return f"({a} {op} {b})", value


@given(arithmetic())
def test_safe_eval_matches_the_arithmetic(expr):
    text, value = expr
    assert safe_eval(text) == value


@pytest.mark.parametrize(
    ("expr", "match"),
    [
        ("__import__('os').system('true')", "unknown function"),
        ("(1).__class__", "unsupported syntax"),
        ("x + 1", "unsupported syntax"),
        ("'a' * 3", "unsupported literal"),
        ("[1, 2]", "unsupported syntax"),
        ("lambda: 1", "unsupported syntax"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("2 ** 1000", "exponent"),
        ("(10 ** 90) * (10 ** 90)", "too large"),
        ("1 < 2", "unsupported syntax"),
        ("True + 1", "unsupported literal"),
        ("sqrt(-1)", "sqrt"),
        ("max(x=1)", "keyword"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 300, "longer than"),
        ("-" * 40 + "1", "nested"),
        ("(-8) ** 0.5", "complex"),
    ],
)
def test_safe_eval_refuses_everything_else(expr, match):
    with pytest.raises(CalcError, match=match):
        safe_eval(expr)


def test_calculator_episode_tool_calls_and_grading():
    env = CalculatorEnv()
    obs, info = env.reset(seed=3)
    assert "Question: what is 77 * 18 - 79?" in obs and info["answer"] == 1307
    key0 = env.state_key()
    obs, r, term, trunc, info = env.step(
        "Let me compute. <tool>calc: 77*18</tool> <tool>calc: 1386 - 79</tool>"
    )
    assert obs == "<result>1386</result>\n<result>1307</result>" and (r, term, trunc) == (0.0, False, False)
    assert info["tool_calls"] == [("calc", "77*18"), ("calc", "1386 - 79")] and env.state_key() != key0
    obs, r, term, trunc, info = env.step("<tool>calc: 1/0</tool>")
    assert obs == "<result>error: division by zero</result>" and not term
    obs, r, term, trunc, info = env.step(r"So the answer is \boxed{1,307}.")
    assert (r, term, info["correct"]) == (1.0, True, True)

    env.reset(seed=3)
    assert env.step("<answer>1306</answer>")[1:3] == (0.0, True)
    env.reset(seed=3)
    assert env.step("no idea")[1:3] == (-0.1, True)
    env.reset(seed=3)
    obs = env.step("<tool>python: print(1)</tool>")[0]
    assert "python tool is not available" in obs
    assert parse_tool_calls("<tool>calc:1</tool><tool>bad</tool>") == [("calc", "1")]


def test_calculator_python_tool_goes_through_the_given_runner():
    def run_python(code: str) -> str:  # a separate isolated interpreter (the sandbox's job here)
        out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=30)
        return out.stdout if out.returncode == 0 else out.stderr.strip().splitlines()[-1]

    env = CalculatorEnv(python_runner=run_python, max_turns=2)
    obs, _ = env.reset(seed=0)
    assert "python" in obs
    obs, _, term, trunc, _ = env.step("<tool>python: print(99 - 7 - 67 - 53)</tool>")
    assert obs.startswith("<result>-28</result>") and (term, trunc) == (False, False)
    obs, _, term, trunc, _ = env.step("<tool>python: 1/0</tool>")
    assert "ZeroDivisionError" in obs and trunc  # max_turns=2 reached
    with pytest.raises(TypeError, match="python_runner"):
        CalculatorEnv(python_runner="python")


# ----------------------------------------------------------------------------- registry, state ids


def test_registry():
    assert {"frozenlake", "sokoban", "calculator"} <= set(list_envs())
    assert isinstance(make_env("sokoban", num_boxes=2), SokobanEnv)
    with pytest.raises(ValueError, match="unknown environment 'nope'"):
        make_env("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_env("frozenlake", FrozenLakeEnv)
    with pytest.raises(TypeError, match="factory"):
        register_env("mine", 3)
    register_env("tiny-lake", "trainers.envs.frozenlake:FrozenLakeEnv")
    try:
        assert make_env("tiny-lake", size=2).size == 2
    finally:
        del ENVS["tiny-lake"]


def test_stable_state_id_is_the_same_in_another_process():
    env = SokobanEnv()
    env.reset(seed=5)
    key = env.state_key()
    code = (
        "from trainers.envs.sokoban import SokobanEnv; from trainers.envs.base import stable_state_id; "
        "e = SokobanEnv(); e.reset(seed=5); print(stable_state_id(e.state_key()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
    )
    assert int(out.stdout.strip()) == stable_state_id(key)
    assert 0 <= stable_state_id(key) < 2**63


# ----------------------------------------------------------------------------- GEM


GEM_GAMES = ["game:GuessTheNumber-v0-easy", "game:Sokoban-v0-easy", "game:Mastermind-v0-easy"]


@pytest.fixture(scope="module")
def gem():
    return pytest.importorskip("gem", reason="gem-llm is not installed")


@pytest.mark.parametrize("gem_id", GEM_GAMES)
def test_gem_games_run_through_the_rollkit_interface(gem, gem_id):
    env = make_env(f"gem:{gem_id}")
    assert isinstance(env, Env)
    obs, info = env.reset(seed=11)
    assert isinstance(obs, str) and obs == make_env(f"gem:{gem_id}").reset(seed=11)[0]
    if info.get("suffix"):
        assert obs.endswith(info["suffix"])  # the board is part of the observation
    k0 = env.state_key()
    for _ in range(3):
        obs, reward, terminated, truncated, info = env.step(env.sample_random_action())
        assert isinstance(obs, str) and isinstance(reward, float)
        assert isinstance(terminated, bool) and isinstance(truncated, bool)
        if terminated or truncated:
            break
    assert isinstance(stable_state_id(env.state_key()), int)
    env.reset(seed=11)
    assert env.state_key() == k0  # same seed, same initial state
    # a format error is GEM's: -0.1 and the episode ends
    assert env.step("no move here")[1:3] == (-0.1, True)


def test_gem_guess_the_number_solved_by_bisection(gem):
    env = make_env("gem:game:GuessTheNumber-v0-hard")  # 1..50 in 7 turns
    for seed in range(3):
        env.reset(seed=seed)
        lo, hi = 1, 50
        for _ in range(7):
            guess = (lo + hi) // 2
            obs, reward, terminated, _, _ = env.step(rf"My guess: \boxed{{{guess}}}")
            if terminated:
                break
            if "higher" in obs:
                lo = guess + 1
            else:
                hi = guess - 1
        assert reward == 1.0 and "Congratulations" in obs


def test_gem_errors(gem):
    with pytest.raises(ValueError, match="did you mean"):
        make_env("gem:game:Sokoban-v9")
    with pytest.raises(TypeError, match="state_fn"):
        make_env("gem:game:Sokoban-v0-easy", state_fn=1)


# ----------------------------------------------------------------------------- text -> turns


@pytest.mark.slow
def test_run_episode_contexts_are_the_trajectory_prefixes_and_logprobs_line_up():
    """With a real tiny Qwen2 and the transformers rollout engine: the context of every turn is a
    prefix of the built trajectory, and the training-side log-probs of the trajectory equal the
    behaviour log-probs the engine reported."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from trainers.engines.base import SamplingParams
    from trainers.engines.hf_rollout import HFRolloutEngine
    from trainers.envs.turns import TurnEncoder, engine_policy, run_episode
    from trainers.models import char_tokenizer, tiny_qwen2

    tok = char_tokenizer()
    model = tiny_qwen2(tok)
    engine = HFRolloutEngine(model, tok)
    base = engine_policy(engine, SamplingParams(max_tokens=6, seed=0))
    contexts = []

    def policy(context, room):
        contexts.append(list(context))
        return base(context, room)

    env = FrozenLakeEnv(size=3, hole_prob=0.0, end_on_format_error=False)
    ep = run_episode(env, policy, TurnEncoder(tok), seed=0, max_turns=3)
    assert len(ep.turns) == 3 and len(ep.observations) == 4
    traj = build_trajectory(ep.turns)
    for k, ctx in enumerate(contexts):
        assert traj.input_ids[: traj.bounds[k, 1]].tolist() == ctx
        assert traj.input_ids[traj.bounds[k, 1] : traj.bounds[k, 2]].tolist() == list(ep.turns[k].action_ids)
    assert tok.decode(traj.prompt_ids) == ep.observations[0] + "\n"
    with torch.no_grad():
        logits = model(traj.input_ids[None]).logits[0].float()
    lp = torch.log_softmax(logits, -1)[:-1].gather(-1, traj.input_ids[1:, None])[:, 0]
    mask = traj.response_mask[1:]
    torch.testing.assert_close(lp[mask], traj.logprobs[1:][mask], atol=1e-4, rtol=0)

    # a context budget stops the episode at a turn boundary
    short = run_episode(env, base, TurnEncoder(tok), seed=0, max_turns=3, max_context=len(contexts[0]) + 20)
    assert short.context_full and len(short.turns) == 1


def test_turn_encoder_chat_template_increments_equal_the_full_render():
    pytest.importorskip("transformers")
    from trainers.envs.turns import TurnEncoder
    from trainers.models import char_tokenizer

    tok = char_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}<bos>{{ m['role'] }}\n{{ m['content'] }}<eos>\n{% endfor %}"
        "{% if add_generation_prompt %}<bos>assistant\n{% endif %}"
    )
    enc = TurnEncoder(tok, system_prompt="Play well.")
    assert enc.chat_template
    action = [*tok("\\boxed{up}", add_special_tokens=False).input_ids, tok.eos_token_id]
    ids = enc.prompt_ids("board 1") + action + enc.obs_ids("board 2", action)
    full = tok.apply_chat_template(
        [
            {"role": "system", "content": "Play well."},
            {"role": "user", "content": "board 1"},
            {"role": "assistant", "content": "\\boxed{up}"},
            {"role": "user", "content": "board 2"},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert ids == tok(full, add_special_tokens=False).input_ids
    # an action cut before its end-of-turn token gets the template's closing glue
    cut = action[:-1]
    assert tok.decode(enc.obs_ids("b", cut)).startswith("<eos>\n<bos>user\nb")
    plain = TurnEncoder(char_tokenizer())
    assert not plain.chat_template and plain.obs_ids("x", action) == plain._encode("\nx\n")
    with pytest.raises(ValueError, match="chat template"):
        TurnEncoder(char_tokenizer(), chat_template=True)
