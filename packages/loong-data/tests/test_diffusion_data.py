"""diffusion-prepare: real captioned media -> latents of a diffusers AutoencoderKLWan and UMT5 text
embeddings in WebDataset shards (reused by fingerprint), the bundled SentencePiece tokenizer equals
mistral-common's model, batches are deterministic per step, bad input names the line."""

from __future__ import annotations

import json
import tarfile

import pytest
import torch

pytest.importorskip("diffusers")

from loong_data.cli import main as cli_main  # noqa: E402
from loong_data.diffusion import bundled_captioned_media, load_latent_samples, prepare_diffusion_shards  # noqa: E402
from loong_data.diffusion.media import jsonl_captioned_media  # noqa: E402
from loong_data.diffusion.prepare import SPM_TOKENIZER, TINY_TEXT_ENCODER, TINY_VAE, Towers, load_frames  # noqa: E402


def test_bundled_tokenizer_is_mistral_commons_sentencepiece():
    spm = pytest.importorskip("sentencepiece")
    mc = pytest.importorskip("mistral_common")
    from pathlib import Path

    from transformers import AutoTokenizer

    ref = spm.SentencePieceProcessor(model_file=str(Path(mc.__file__).parent / "data" / "tokenizer.model.v1"))
    tok = AutoTokenizer.from_pretrained(SPM_TOKENIZER)
    for item in bundled_captioned_media():
        assert tok(item.caption).input_ids == ref.encode(item.caption) + [tok.eos_token_id], item.caption


def test_bundled_set_has_captioned_photos_digits_and_clips():
    items = bundled_captioned_media()
    assert len(items) == 223 and len({i.id for i in items}) == 223
    by_id = {i.id: i for i in items}
    assert by_id["astronaut"].caption == "Color image of the astronaut Eileen Collins."
    assert by_id["digit-0003"].caption == "A handwritten digit 3."
    clip = by_id["video-pan-coins"]
    assert len(clip.frames) == 8 and clip.caption == "Greek coins from Pompeii. The view moves from left to right."


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    items = [i for i in bundled_captioned_media() if not i.id.startswith("digit")][:8]  # 6 photos... + clips
    items = items[:6] + [i for i in bundled_captioned_media() if i.id.startswith("video")][:1]
    out = tmp_path_factory.mktemp("d") / "shards"
    res = prepare_diffusion_shards(items, out, vae=TINY_VAE, text_encoder=TINY_TEXT_ENCODER, text_len=16, size=32,
                                   maxcount=4)  # fmt: skip
    return items, res


def test_shards_hold_normalised_vae_latents_and_masked_text_embeddings(prepared):
    items, res = prepared
    assert not res.reused and res.meta["shards"] == ["shard-000000.tar", "shard-000001.tar"]
    with tarfile.open(res.out_dir / "shard-000000.tar") as tar:
        assert {n.split(".", 1)[1] for n in tar.getnames()} == {"latents.pth", "context.pth", "json"}
    samples = load_latent_samples(res.out_dir)
    assert sorted(samples.ids) == sorted(i.id for i in items)
    towers = Towers.load(res.out_dir)  # the saved towers reproduce every sample
    mean, std = torch.tensor(res.meta["latent_mean"]), torch.tensor(res.meta["latent_std"])
    for k, sid in enumerate(samples.ids):
        item = next(i for i in items if i.id == sid)
        video = load_frames(item, 32, 4)
        z = towers.encode_video(video[None])[0]
        want = (z - mean[:, None, None, None]) / std[:, None, None, None]
        assert torch.allclose(samples.latents[k], want, atol=1e-5)
        ctx = towers.encode_text([item.caption])[0]
        assert torch.allclose(samples.contexts[k], ctx, atol=1e-6)
        n = len(towers.tokenizer(item.caption).input_ids)
        assert ctx[:n].abs().sum(-1).gt(0).all() and ctx[n:].abs().sum() == 0  # zero past the caption, as Wan
    shapes = {tuple(z.shape) for z in samples.latents}
    assert shapes == {(4, 1, 8, 8), (4, 3, 8, 8)}  # photos: 1 frame; the clip: 5 of its 8 frames -> 3 latent frames
    flat = torch.cat([z.flatten(1) for z in samples.latents], 1)
    assert torch.allclose(flat.mean(1), torch.zeros(4), atol=1e-4) and torch.allclose(flat.std(1), torch.ones(4), atol=1e-4)
    clip = next(i for i in items if i.id.startswith("video"))
    assert towers.decode(towers.encode_video(load_frames(clip, 32, 4)[None])).shape == (1, 3, 5, 32, 32)


def test_a_second_prepare_reuses_the_shards(prepared, tmp_path):
    items, res = prepared
    again = prepare_diffusion_shards(items, res.out_dir, vae=TINY_VAE, text_encoder=TINY_TEXT_ENCODER, text_len=16,
                                     size=32, maxcount=4)  # fmt: skip
    assert again.reused and again.meta == res.meta


def test_step_batches_are_a_function_of_the_step(prepared):
    samples = load_latent_samples(prepared[1].out_dir)
    a = samples.step_batch(5, 4, seed=1)
    assert a == samples.step_batch(5, 4, seed=1) and a[1] == [20, 21, 22, 23]
    assert len({tuple(samples.latents[i].shape) for i in a[0]}) == 1  # one latent shape per batch
    assert any(samples.step_batch(s, 4, seed=1)[0] != a[0] for s in range(6, 10))


def test_bad_captioned_jsonl_names_the_line(tmp_path, capsys):
    p = tmp_path / "set.jsonl"
    p.write_text(json.dumps({"media": "a.png", "caption": "x"}) + "\n" + json.dumps({"caption": "y"}) + "\n")
    with pytest.raises(ValueError, match=r"set.jsonl:1: media file .*a.png does not exist"):
        jsonl_captioned_media(p)
    assert cli_main(["diffusion-prepare", "--input", str(p), "--out", str(tmp_path / "o")]) == 1
    assert "set.jsonl:1" in capsys.readouterr().err
