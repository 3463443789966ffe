"""MediaPreparer.prepare: the package's public surface, end to end over respx and real images."""

from __future__ import annotations

import httpx
import pytest
import respx

from rankgate.multimodal import MediaError, MediaRef
from rankgate.multimodal.identity import content_identity, url_identity
from tests.multimodal.conftest import MakePreparer
from tests.multimodal.pictures import data_uri, encode, noise, png_claiming

CAT = "http://images.example.com/cat.webp"
DOG = "https://cdn.example.com/dog.jpg"


async def image_error(
    make_preparer: MakePreparer, refs: list[MediaRef], **config: object
) -> MediaError:
    with pytest.raises(MediaError) as caught:
        await make_preparer(**config).prepare(refs)
    return caught.value


@respx.mock
async def test_url_and_data_uri_become_media_inputs(make_preparer: MakePreparer) -> None:
    cat, dog = noise(64, 48, seed=1), noise(30, 30, seed=2)
    cat_webp = encode(cat, "WEBP", lossless=True)
    respx.get(CAT).respond(200, content=cat_webp)
    dog_png = encode(dog, "PNG")
    media = await make_preparer().prepare([MediaRef(CAT), MediaRef(data_uri(dog_png))])
    assert [m.uuid for m in media] == [content_identity(cat_webp), content_identity(dog_png)]
    assert [m.mime_type for m in media] == ["image/webp", "image/png"]
    assert [m.data for m in media] == [cat_webp, dog_png]
    assert [m.url for m in media] == [None, None]
    assert [m.num_tokens for m in media] == [None, None]


@respx.mock
async def test_same_bytes_any_transport_one_uuid(make_preparer: MakePreparer) -> None:
    picture = noise(40, 40, seed=3)
    png, webp = encode(picture, "PNG"), encode(picture, "WEBP", lossless=True)
    respx.get(CAT).respond(200, content=webp)
    respx.get(DOG).respond(200, content=png)
    refs = [
        MediaRef(CAT),
        MediaRef(DOG),
        MediaRef(data_uri(png)),
        MediaRef(data_uri(webp, "image/webp")),
    ]
    media = await make_preparer().prepare(refs)
    ids = [content_identity(webp), content_identity(png)]
    assert [m.uuid for m in media] == [*ids, *reversed(ids)]


@respx.mock
async def test_repeated_images_are_fetched_and_decoded_once(make_preparer: MakePreparer) -> None:
    route = respx.get(CAT).respond(200, content=encode(noise(20, 20, seed=4), "PNG"))
    inline = data_uri(encode(noise(20, 20, seed=5), "PNG"))
    preparer = make_preparer()
    media = await preparer.prepare(
        [MediaRef(CAT), MediaRef(inline), MediaRef(CAT), MediaRef(inline)]
    )
    assert media[0] == media[2]
    assert media[1] == media[3]
    assert route.call_count == 1
    assert preparer.decoder.decoded == 2


async def test_client_uuid_is_used_as_given(make_preparer: MakePreparer) -> None:
    inline = data_uri(encode(noise(8, 8), "PNG"))
    media = await make_preparer().prepare([MediaRef(inline, uuid="client-id-1"), MediaRef(inline)])
    assert media[0].uuid == "client-id-1"
    assert media[1].uuid == content_identity(encode(noise(8, 8), "PNG"))


@respx.mock
async def test_passthrough_sends_urls_unfetched(make_preparer: MakePreparer) -> None:
    route = respx.route().respond(200)
    inline = encode(noise(8, 8), "PNG")
    media = await make_preparer(mode="passthrough").prepare(
        [MediaRef(CAT), MediaRef(data_uri(inline))]
    )
    assert (media[0].url, media[0].data, media[0].uuid) == (CAT, None, url_identity(CAT))
    assert (media[1].data, media[1].uuid) == (inline, content_identity(inline))
    assert not route.called


async def test_qwen_model_gets_token_counts_from_the_formula(make_preparer: MakePreparer) -> None:
    preparer = make_preparer(model_id="Qwen/Qwen2.5-VL-7B-Instruct")
    media = await preparer.prepare([MediaRef(data_uri(encode(noise(640, 480), "JPEG")))])
    assert media[0].num_tokens == 23 * 17


async def test_other_models_learn_counts_from_vllm(make_preparer: MakePreparer) -> None:
    preparer = make_preparer(model_id="some/unknown-vlm")
    refs = [MediaRef(data_uri(encode(noise(64, 64, seed=8), "PNG")))]
    first = await preparer.prepare(refs)
    assert first[0].num_tokens is None
    preparer.observe(first, prompt_len=20, expanded_prompt_tokens=19 + 81)
    again = await preparer.prepare(refs)
    assert again[0].num_tokens == 81


async def test_too_many_images(make_preparer: MakePreparer) -> None:
    inline = MediaRef(data_uri(encode(noise(4, 4), "PNG")))
    error = await image_error(make_preparer, [inline] * 3, max_images=2)
    assert (error.status, error.index) == (400, 2)
    assert error.message == "image 2: too many images: the request has 3, at most 2 allowed"


async def test_too_big_data_uri(make_preparer: MakePreparer) -> None:
    small = MediaRef(data_uri(encode(noise(4, 4), "PNG")))
    big = MediaRef(data_uri(encode(noise(64, 64), "PNG")))
    error = await image_error(make_preparer, [small, big], max_image_bytes=2000)
    assert (error.status, error.index) == (400, 1)
    assert error.message.startswith("image 1: data URI payload of ")
    assert error.message.endswith("bytes is over the limit of 2000 bytes")


@respx.mock
async def test_too_big_url(make_preparer: MakePreparer) -> None:
    respx.get(CAT).respond(200, content=b"x" * 5000)
    error = await image_error(make_preparer, [MediaRef(CAT)], max_image_bytes=4096)
    assert (error.status, error.message) == (
        400,
        f"image 0: {CAT} is 5000 bytes, over the limit of 4096 bytes",
    )


async def test_decompression_bomb(make_preparer: MakePreparer) -> None:
    refs = [MediaRef(data_uri(png_claiming(6000, 6000)))]
    error = await image_error(make_preparer, refs)
    assert error.status == 400
    assert error.message == (
        "image 0: 6000x6000 is 36000000 pixels, over the limit of 33177600 "
        "(decompression bomb guard)"
    )


async def test_corrupt_and_truncated(make_preparer: MakePreparer) -> None:
    good = MediaRef(data_uri(encode(noise(8, 8), "PNG")))
    png = encode(noise(64, 64), "PNG")
    error = await image_error(make_preparer, [good, MediaRef(data_uri(png[: len(png) // 2]))])
    assert (error.status, error.index) == (400, 1)
    assert error.message.startswith("image 1: truncated PNG data")
    error = await image_error(make_preparer, [MediaRef(data_uri(b"garbage!"))])
    assert error.message == (
        "image 0: corrupt or unrecognised image data (allowed: JPEG, PNG, WEBP, GIF)"
    )


async def test_disallowed_format(make_preparer: MakePreparer) -> None:
    bmp = MediaRef(data_uri(encode(noise(8, 8), "BMP"), "image/bmp"))
    error = await image_error(make_preparer, [bmp])
    assert (error.status, error.message) == (
        400,
        "image 0: format BMP is not allowed (allowed: JPEG, PNG, WEBP, GIF)",
    )


@respx.mock
async def test_private_address(make_preparer: MakePreparer) -> None:
    route = respx.route().respond(200)
    error = await image_error(make_preparer, [MediaRef("http://169.254.169.254/latest/")])
    assert (error.status, error.message) == (
        400,
        "image 0: 169.254.169.254, a link-local address; fetching it is not allowed",
    )
    assert not route.called


@respx.mock
async def test_redirect_to_private_address(make_preparer: MakePreparer) -> None:
    respx.get(CAT).respond(302, headers={"location": "http://intranet.example.com/cat.webp"})
    error = await image_error(make_preparer, [MediaRef(CAT)])
    assert (error.status, error.message) == (
        400,
        "image 0: host intranet.example.com resolves to 10.1.2.3, a private address; "
        "fetching it is not allowed",
    )


@respx.mock
async def test_timeout(make_preparer: MakePreparer) -> None:
    respx.get(DOG).mock(side_effect=httpx.ReadTimeout("slow"))
    inline = MediaRef(data_uri(encode(noise(8, 8), "PNG")))
    error = await image_error(make_preparer, [inline, MediaRef(DOG)])
    assert (error.status, error.message) == (
        400,
        f"image 1: fetching {DOG} timed out while reading",
    )


@respx.mock
async def test_allow_list_admits_a_private_host(make_preparer: MakePreparer) -> None:
    url = "http://intranet.example.com/ok.png"
    respx.get(url).respond(200, content=encode(noise(8, 8), "PNG"))
    media = await make_preparer(allowed_networks=("10.0.0.0/8",)).prepare([MediaRef(url)])
    assert media[0].uuid == content_identity(encode(noise(8, 8), "PNG"))


@respx.mock
async def test_the_lowest_index_refusal_wins(make_preparer: MakePreparer) -> None:
    respx.get(CAT).respond(404)
    refs = [MediaRef(data_uri(b"junk")), MediaRef(CAT), MediaRef("http://10.0.0.1/x.png")]
    error = await image_error(make_preparer, refs)
    assert error.index == 0


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        (
            MediaRef("ftp://images.example.com/a.png"),
            "image url must be a data: URI or an http(s):// URL",
        ),
        (MediaRef("data:,x", detail="ultra"), "detail must be one of auto, low, high; got 'ultra'"),
        (MediaRef("data:,x", uuid=""), "uuid must be 1 to 256 characters"),
        (MediaRef("data:,x", uuid="tab\there"), "uuid must be printable ASCII"),
        (MediaRef("data:text/html,<b>hi</b>"), "data URI media type text/html is not an image"),
    ],
)
async def test_malformed_refs(make_preparer: MakePreparer, ref: MediaRef, message: str) -> None:
    error = await image_error(make_preparer, [ref])
    assert (error.status, error.message) == (400, f"image 0: {message}")


async def test_qwen_refuses_extreme_aspect_ratios(make_preparer: MakePreparer) -> None:
    sliver = MediaRef(data_uri(encode(noise(1, 300), "PNG")))
    error = await image_error(make_preparer, [sliver], model_id="Qwen/Qwen2-VL-2B-Instruct")
    assert (
        error.message == "image 0: aspect ratio of 1x300 is over 200, which Qwen2-VL models refuse"
    )
