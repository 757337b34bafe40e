"""Counting what Inductor's generated code calls (zerocc/backends/inductor/generated_calls.py), on a
module written as Inductor writes one for a GPU (Triton kernels launched with ``.run``), and
finding that module among those Inductor loads; the CPU form, on code Inductor generated here,
is in test_inductor.py."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from zerocc.backends.inductor.executable import generated_code, loaded_modules
from zerocc.backends.inductor.generated_calls import GeneratedCalls, calls_in

TRITON_MODULE = '''
triton_poi_fused_add_0 = async_compile.triton('triton_poi_fused_add_0', """
import triton
@triton.jit
def triton_poi_fused_add_0(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    tmp0 = tl.load(in_ptr0 + (x0), xmask)
    tl.store(out_ptr0 + (x0), extern_kernels.mm(tmp0), xmask)
""", device_str='cuda')
async_compile.wait(globals())

class Runner:
    def call(self, args):
        arg0_1, = args
        with torch.cuda._DeviceGuard(0):
            buf0 = torch.ops.zerocc_lowered.all_gather_start.default(arg0_1, 2, 'dp', 'ag')
            assert_size_stride(buf0, (8, ), (1, ), 'torch.ops.zerocc_lowered.wait.default')
            torch.ops.zerocc_lowered.wait.default(buf0, [], 'ag')
            buf1 = empty_strided_cuda((4, 2), (2, 1), torch.float32)
            # Topologically Sorted Source Nodes: [mm], Original ATen: [aten.mm]
            extern_kernels.mm(reinterpret_tensor(buf0, (4, 2), (2, 1), 0), buf0, out=buf1)
            stream0 = get_raw_stream(0)
            triton_poi_fused_add_0.run(buf1, buf2, 8, stream=stream0)
            triton_poi_fused_add_0.run(buf2, buf3, 8, stream=stream0)
            buf4 = torch.ops.aten._efficient_attention_forward.default(buf3, buf3, buf3)
            buf5 = torch.ops.inductor._alloc_from_pool(buf4, 0, torch.float32, (8, ), (1, ))
'''


def test_calls_are_counted_by_kind_and_the_kernels_sources_left_out():
    calls = calls_in(TRITON_MODULE)
    assert (calls.kernels, calls.kernel_calls) == (1, 2)
    assert calls.library == Counter({"mm": 1})  # not the one in the kernel's source
    assert calls.aten == Counter({"_efficient_attention_forward": 1})  # not Inductor's helper
    assert calls.zerocc == Counter({"all_gather_start": 1, "wait": 1})  # not the assert's name
    assert calls.summary() == "2 calls of 1 generated kernels, 1 library, 1 ATen, 2 zerocc"


def test_modules_add_up_each_with_kernels_of_its_own():
    """Two regions' modules both name their first kernel ``..._0``: two kernels, not one."""
    both = calls_in(TRITON_MODULE) + calls_in(TRITON_MODULE)
    assert (both.kernels, both.kernel_calls) == (2, 4)
    assert both.zerocc == Counter({"all_gather_start": 2, "wait": 2})
    assert both.by_name()[0] == "Inductor's kernels: 4 calls of 2"
    assert GeneratedCalls().by_name()[1:] == ["library: none", "ATen: none", "zerocc: none"]


def test_the_wrapper_is_read_though_the_kernels_modules_load_after_it():
    """On a GPU the wrapper, as it loads, loads each Triton kernel's module
    (``async_compile.triton``), so the last module loaded is a kernel's. Reading that one, an
    H100 counted a whole GPT step as one call of one kernel; the wrapper is what counts."""
    from torch._inductor.codecache import PyCodeCache

    kernel = "def triton_poi_fused_add_0(in_ptr0):\n    return in_ptr0\n"
    wrapper = (
        "from torch._inductor.codecache import PyCodeCache\n"
        f'triton_poi_fused_add_0 = PyCodeCache.load("""{kernel}""").triton_poi_fused_add_0\n'
        "def call(args):\n"
        "    extern_kernels.mm(args, args, out=args)\n"
        "    triton_poi_fused_add_0.run(args)\n"
        "    triton_poi_fused_add_0.run(args)\n"
    )
    with loaded_modules() as loaded:
        PyCodeCache.load(wrapper)
    assert [Path(path).read_text() for path in loaded] == [wrapper, kernel]
    code = generated_code(loaded)
    assert code == wrapper
    assert calls_in(code).summary() == "2 calls of 1 generated kernels, 1 library, 0 ATen, 0 zerocc"
    assert generated_code(loaded[1:]) is None  # no wrapper among them: nothing to count
