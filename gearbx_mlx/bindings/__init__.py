"""The bindings of the custom kernels: build, load, launch, check on first use.

One home for everything between the kernel sources and the layers that use
them. The GPU bodies (Metal, with their CUDA twins) are the top-level
``metal_kernels/`` folder; the C kernels are ``csrc/`` next to their cffi
build.

* :mod:`.build`: the cffi build of ``csrc/`` into ``_gearbx_cpu`` (``setup.py``
  calls it; ``python gearbx_mlx/bindings/build.py`` builds in place);
* :mod:`.kernel_files`: where ``metal_kernels/`` is, and the integer constants
  of its format header ``gearbx_format.h``;
* :mod:`.gpu`: what every GPU kernel shares: the back end of the default
  device, the text assembly (format header, prelude, helpers, entry, body),
  and the one cached ``mx.fast`` kernel build;
* :mod:`.cpu`: the C library's loader, and the packed int4/int8 GEMV on it;
* launchers: :mod:`.packed_gpu` (packed GEMV on Metal and CUDA),
  :mod:`.nested_gpu` and :mod:`.nested_cpu` (a gear of nested planes);
* :mod:`.guard`: a kernel's first call checked against the reference, with
  the fallback to MLX and its one warning.

``gearbx_mlx.packed``, ``gearbx_mlx.nested`` and ``gearbx_mlx.kvcache``
import these modules' public names; nothing here imports them back (only the
packed format's reference, :mod:`gearbx_mlx.packed.formats`, below them all).
Importing has no side effects: nothing is read, loaded or compiled.
"""
