"""Audio and video checks: what is measured, what is refused, and that no header is trusted."""

from __future__ import annotations

import pytest

from rankgate.multimodal.clips import ClipDecoder, ClipLimits, probe_clip, sniff_container
from rankgate.multimodal.errors import MediaRefused
from rankgate.multimodal.identity import content_identity
from rankgate.multimodal.isolation import DecoderLimits, DecoderPool
from tests.multimodal.clips import encoded_audio, video, wav, wav_declaring

AUDIO = ClipLimits(
    kind="audio",
    containers=("wav", "flac", "mp3", "ogg", "webm", "mp4"),
    max_seconds=600.0,
    max_decoded_bytes=256 << 20,
)
VIDEO = ClipLimits(
    kind="video",
    containers=("mp4", "webm"),
    max_seconds=600.0,
    max_frames=36_000,
    max_frame_pixels=3840 * 2160,
)


def limits(base: ClipLimits, **changes: object) -> ClipLimits:
    import msgspec

    return msgspec.structs.replace(base, **changes)


def flac_declaring(total_samples: int, seconds: float = 1.0) -> bytes:
    """A real FLAC whose STREAMINFO claims ``total_samples`` (36 bits at bytes 21-25)."""
    data = bytearray(encoded_audio("flac", "flac", seconds=seconds))
    assert data[:4] == b"fLaC"
    packed = int.from_bytes(data[18:26], "big")
    packed = (packed & ~((1 << 36) - 1)) | total_samples
    data[18:26] = packed.to_bytes(8, "big")
    return bytes(data)


@pytest.mark.parametrize(
    ("container", "codec", "rate", "mime"),
    [
        ("flac", "flac", 16_000, "audio/flac"),
        ("mp3", "libmp3lame", 16_000, "audio/mpeg"),
        ("ogg", "libopus", 48_000, "audio/ogg"),
        ("webm", "libopus", 48_000, "audio/webm"),
        ("mp4", "aac", 16_000, "audio/mp4"),
    ],
)
def test_compressed_audio_is_measured_by_decoding_it(
    container: str, codec: str, rate: int, mime: str
) -> None:
    data = encoded_audio(container, codec, seconds=1.5, rate=rate)
    clip = probe_clip(data, AUDIO)
    assert (clip.container, clip.mime_type, clip.sample_rate) == (container, mime, rate)
    assert clip.seconds == pytest.approx(1.5, abs=0.1)
    assert clip.uuid == content_identity(data)
    assert clip.data is data


def test_a_wav_is_measured_to_the_sample() -> None:
    clip = probe_clip(wav(2.0, rate=22_050, channels=2), AUDIO)
    assert (clip.codec, clip.sample_rate, clip.samples) == ("pcm_s16le", 22_050, 44_100)
    assert clip.shape == (3, 22_050, 44_100)


@pytest.mark.parametrize(
    ("container", "codec", "frames", "fps"),
    [("mp4", "mpeg4", 8, 4), ("mp4", "libx264", 30, 10), ("webm", "libvpx", 6, 3)],
)
def test_a_video_is_measured_from_its_packets(
    container: str, codec: str, frames: int, fps: int
) -> None:
    data = video(container, codec, frames=frames, width=64, height=48, fps=fps)
    clip = probe_clip(data, VIDEO)
    assert (clip.width, clip.height, clip.frames) == (64, 48, frames)
    assert clip.seconds == pytest.approx(frames / fps, abs=0.01)
    assert clip.mime_type == f"video/{container}"


def test_containers_are_told_by_their_first_bytes() -> None:
    assert sniff_container(wav()) == "wav"
    assert sniff_container(video()) == "mp4"
    assert sniff_container(video("webm", "libvpx")) == "webm"
    assert sniff_container(encoded_audio("mp3", "libmp3lame")) == "mp3"
    assert sniff_container(b"<html>not media</html>") is None


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "empty audio data"),
        (b"\x00" * 64, "unrecognised audio data"),
        (b"RIFF\x24\x00\x00\x00WAVEfmt ", "corrupt or truncated wav audio"),
        (wav_declaring(0, 0), "the wav audio holds no samples"),
        (video(), "the mp4 data has no audio stream"),
    ],
)
def test_audio_that_is_not_audio_is_refused(data: bytes, message: str) -> None:
    with pytest.raises(MediaRefused, match=message):
        probe_clip(data, AUDIO)


def test_a_container_off_the_allow_list_never_reaches_ffmpeg() -> None:
    with pytest.raises(MediaRefused, match="audio container mp3 is not allowed"):
        probe_clip(encoded_audio("mp3", "libmp3lame"), limits(AUDIO, containers=("wav",)))
    with pytest.raises(MediaRefused, match="video container avi is not allowed"):
        probe_clip(b"RIFF\x00\x00\x00\x00AVI LIST", VIDEO)


def test_a_huge_declared_duration_in_a_tiny_file_is_refused_from_its_header() -> None:
    hours = flac_declaring(2**36 - 1)  # about 50 days at 16 kHz, in 20 KB
    assert len(hours) < 64_000
    with pytest.raises(MediaRefused, match=r"audio declares \d+\.\d s, over the limit of 600 s"):
        probe_clip(hours, AUDIO)


def test_a_wav_header_declaring_days_is_refused_before_decoding() -> None:
    """FFmpeg clamps the declared size to the bytes present; the header's own claim counts."""
    days = wav_declaring(data_bytes=0xFFFF_FFF0, actual_bytes=32_000, rate=8_000)
    with pytest.raises(MediaRefused, match=r"audio declares \d+\.\d s, over the limit of 600 s"):
        probe_clip(days, AUDIO)


@pytest.mark.parametrize("size", [0, 0xFFFF_FFFF])
def test_a_streamed_wav_of_unknown_size_is_measured_by_decoding(size: int) -> None:
    probed = probe_clip(wav_declaring(data_bytes=size, actual_bytes=32_000), AUDIO)
    assert probed.seconds == pytest.approx(1.0)


def test_a_header_that_understates_the_duration_is_caught_while_decoding() -> None:
    """The header says half a second; the data holds three: decoding stops past the limit."""
    liar = flac_declaring(8_000, seconds=3.0)
    with pytest.raises(MediaRefused, match="audio decodes to more, over the limit of 1 s"):
        probe_clip(liar, limits(AUDIO, max_seconds=1.0))


def test_decoding_stops_at_the_decoded_size_limit() -> None:
    """Silence compresses to almost nothing; what it decodes to is what is bounded."""
    silence = encoded_audio("flac", "flac", seconds=20.0, tone=0.0)
    assert len(silence) < 100_000
    with pytest.raises(MediaRefused, match="decodes to more, over the limit of 100000 bytes"):
        probe_clip(silence, limits(AUDIO, max_decoded_bytes=100_000))


def test_truncated_flac_is_refused_as_truncated() -> None:
    data = encoded_audio("flac", "flac", seconds=4.0)
    with pytest.raises(MediaRefused, match=r"truncated flac audio|corrupt or truncated flac"):
        probe_clip(data[: len(data) // 3], AUDIO)


@pytest.mark.parametrize(
    ("data", "changes", "message"),
    [
        (video(frames=8), {"max_frames": 4}, "video declares 8 frames, over the limit of 4"),
        (
            video("webm", "libvpx", frames=8),
            {"max_frames": 4},
            "video holds more frames, over the limit of 4 frames",
        ),
        (
            video(frames=8, fps=2),
            {"max_seconds": 2.0},
            "video declares 4.0 s, over the limit of 2 s",
        ),
        (
            video(width=64, height=48),
            {"max_frame_pixels": 1000},
            "video frames of 64x48 are 3072 pixels, over the limit of 1000 pixels",
        ),
        (wav(), {}, "video container wav is not allowed"),
        (encoded_audio("mp4", "aac"), {}, "the mp4 data has no video stream"),
    ],
)
def test_videos_past_a_limit_are_refused_before_decoding(
    data: bytes, changes: dict[str, object], message: str
) -> None:
    with pytest.raises(MediaRefused, match=message):
        probe_clip(data, limits(VIDEO, **changes))


def test_a_webm_running_past_the_limit_is_caught_from_its_packets() -> None:
    """WebM need not state a duration; the packets' timestamps give it away."""
    with pytest.raises(MediaRefused, match=r"video (runs longer|declares)"):
        probe_clip(video("webm", "libvpx", frames=12, fps=2), limits(VIDEO, max_seconds=3.0))


async def test_the_decoder_probes_each_clip_once_and_recalls_it() -> None:
    pool = DecoderPool(DecoderLimits(workers=1))
    decoder = ClipDecoder(AUDIO, VIDEO, pool, memo=1 << 20)
    try:
        data = wav(1.0, tone=123.0)
        first = await decoder.probe("audio", data)
        second = await decoder.probe("audio", data)
        assert first == second
        assert (decoder.decoded, decoder.recalled) == (1, 1)
        # The same bytes as another kind are another question.
        with pytest.raises(MediaRefused, match="video container wav is not allowed"):
            await decoder.probe("video", data)
        assert first.data is data
        assert pool.started == 1
    finally:
        decoder.close()
        pool.close()
