"""First-party rewards, registered through the ``gyremedia`` entry point like any third party's."""

from gyremedia import hookimpl
from gyremedia_rewards.compressibility import JpegCompressibility, JpegOptions


@hookimpl
def gyremedia_register_rewards(register):
    register("jpeg_compressibility", JpegCompressibility, options=JpegOptions, kinds={"image"},
             description="DDPO's compressibility: minus the JPEG size of the image in kB")
