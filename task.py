"""Types of the nvfp4_group_gemm problem, as the GPU MODE runner defines them."""
from typing import TypedDict, TypeVar

import torch

input_t = TypeVar(
    "input_t",
    bound=tuple[
        list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],  # (a, b, c) per group
        list[tuple[torch.Tensor, torch.Tensor]],  # (sfa, sfb) per group, plain layout
        list[tuple[torch.Tensor, torch.Tensor]],  # (sfa, sfb) per group, blocked (tcgen05) layout
        list[tuple[int, int, int, int]],  # (m, n, k, l) per group
    ],
)
output_t = TypeVar("output_t", bound=list[torch.Tensor])


class TestSpec(TypedDict):
    m: tuple[int, ...]
    n: tuple[int, ...]
    k: tuple[int, ...]
    g: int
    seed: int
