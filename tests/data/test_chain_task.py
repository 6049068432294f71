"""The chain task: sums of 8-16 digits solved step by step, completions of 41-126 tokens."""

from grpokit.data import get_task
from grpokit.data.tasks import chain_answer, chain_solution


def test_a_solution_writes_every_running_total_in_either_style():
    assert chain_solution([37, 25, 18, 41, 9], "full") == "37+25=62,62+18=80,80+41=121,121+9=130;130"
    assert chain_solution([37, 25, 18, 41, 9], "short") == "+25=62,+18=80,+41=121,+9=130;130"


def test_the_answer_is_what_follows_the_last_semicolon():
    assert chain_answer("37+25=62;62") == "62" and chain_answer("1;2; 62 ") == "62"
    assert chain_answer("37+25=62,62") == ""  # no ';': no answer, however right the last total


def test_every_row_is_its_own_right_answer_and_only_the_sum_is_judged():
    task = get_task("chain")
    assert task.accuracy([r["answer"] for r in task.eval], task.eval) == 1.0
    row = task.eval[0]
    total = int(row["result"])
    assert task.is_correct(f";{total}", row)  # the steps are not checked: the exact answer is the reward
    assert not task.is_correct(row["answer"][:-1] + str((total + 1) % 10), row)
    assert task.reward([row["prompt"]] * 2, [row["answer"], ";0"], result=[row["result"]] * 2) == [1.0, 0.0]


def test_rows_are_sums_of_8_to_16_digits_with_completions_of_32_to_128_tokens():
    task = get_task("chain")
    rows = task.train + task.eval
    assert len(rows) == 20000
    styles = {"full": 0, "short": 0}
    for row in rows:
        terms = [int(t) for t in row["prompt"].removesuffix("=").split("+")]
        assert 8 <= len(terms) <= 16 and all(1 <= t <= 9 for t in terms)
        assert row["result"] == str(sum(terms)) and row["answer"] == chain_solution(terms, row["style"])
        # the character tokenizer: one token a character, plus EOS
        assert 32 <= len(row["answer"]) + 1 <= task.max_completion_length == 128
        assert set(row["answer"]) <= set(task.alphabet) and len(row["prompt"]) <= task.max_prompt_length
        styles[row["style"]] += 1
    assert abs(styles["full"] - styles["short"]) < 0.03 * len(rows)  # the length is half the policy's choice
