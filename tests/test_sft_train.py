"""SFT through the real train app: chat conversations, loss on the assistant's tokens only (the
mask itself: packages/loong-data/tests/test_chat_text.py). ~1 min of CPU."""


SFT = ["phase=sft", "model.foundation.vocab_size=8320", "data.seq_length=64", "train.eval_iters=1",
       "optim.lr=3e-3", "train.save_final=false"]  # fmt: skip


def test_sft_on_bundled_chat_learns_the_answers(run_train):
    run = run_train([*SFT, "train.steps=12", "train.eval_interval=0"], name="sft").check()
    losses = run.losses()
    assert sorted(losses) == list(range(1, 13))
    # answers are short and repetitive (titles): assistant-token loss drops fast from ~ln(8320)
    assert losses[1] > 8.5 and min(losses[s] for s in range(10, 13)) < losses[1] - 0.7, losses
    assert run.records("val")  # held-out conversations are evaluated


def test_chat_data_config_errors(run_train):
    thd = run_train([*SFT, "train.steps=1", "data.packing=thd"], name="thd")
    assert (
        thd.returncode != 0 and "data.kind=chat trains one conversation per data.seq_length row" in thd.stderr
    )
    small = run_train(["phase=sft", "train.steps=1"], name="small-vocab")
    assert (
        small.returncode != 0
        and "model.foundation.vocab_size=8192 is smaller than the tokenizer's" in small.stderr
    )
