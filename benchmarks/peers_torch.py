"""The PyTorch child of `python -m benchmarks --peers`: torch.func vmap(grad), and DP-SGD
steps by Opacus (hooks and ghost clipping), on each job's model with the TensorFlow
model's weights.

Notation: that of `benchmarks.peers_jobs` (B examples, C clip norm, σ noise
multiplier, lr learning rate, g_i example i's gradient, n_i = ||g_i||_2).

Layouts. The job folder holds every array in TensorFlow's layout: Dense kernel
[in, out], Conv2D kernel HWIO [h, w, in, out], images NHWC [B, H, W, C], and the
per-example gradients [B, *x.shape]. PyTorch holds Linear weight [out, in], Conv2d
weight OIHW [out, in, h, w] and images NCHW; its per-example gradients are brought
back to TensorFlow's layout before the comparison. The JAX models are written in
TensorFlow's layouts (lax.conv_general_dilated with ("NHWC", "HWIO", "NHWC")).
A Flatten after a convolution flattens NHWC in (H, W, C) order: the PyTorch CNN
permutes NCHW to NHWC before flattening, so the Dense kernel needs no reordering.
"""

import warnings

import numpy as np

from benchmarks import peers_jobs
from benchmarks import records

__all__ = ["torch_entries"]


def _torch_model(torch, job):
    """The job's model as a torch.nn.Module with its weights loaded (OIHW, [out, in])."""
    nn = torch.nn
    F = torch.nn.functional
    shapes = [tuple(s) for s in job.meta["shapes"]]

    class Net(nn.Module):
        """mlp: Linear+ReLU ... Linear; cnn: Conv(elu) -> NHWC flatten -> Linear(relu) ->
        Linear; cifar: 3 x (Conv relu), AvgPool 2 after the first two, global average
        pool, Linear."""

        def __init__(self):
            super().__init__()
            layers = []
            for kernel in shapes[::2]:
                if len(kernel) == 4:                      # HWIO
                    h, _, i, o = kernel
                    layers.append(nn.Conv2d(i, o, h, padding=h // 2))
                else:                                     # [in, out]
                    layers.append(nn.Linear(*kernel))
            self.layers = nn.ModuleList(layers)

        def forward(self, x):
            if job.model == "mlp":
                for k, layer in enumerate(self.layers):
                    x = layer(x)
                    x = F.relu(x) if k + 1 < len(self.layers) else x
                return x
            # NHWC -> NCHW [B, C, H, W], contiguous: Opacus 1.6's conv grad sampler
            # (hooks) is wrong on channels-last strides, which avg_pool2d would keep
            x = x.permute(0, 3, 1, 2).contiguous()
            if job.model == "cnn":
                conv, dense1, dense2 = self.layers
                x = F.elu(conv(x))                        # [B, 16, H, W]
                x = x.permute(0, 2, 3, 1).flatten(1)      # [B, H*W*16], TF's order
                return dense2(F.relu(dense1(x)))          # [B, 1]
            conv1, conv2, conv3, dense = self.layers
            x = F.avg_pool2d(F.relu(conv1(x)), 2)         # [B, 32, H/2, W/2]
            x = F.avg_pool2d(F.relu(conv2(x)), 2)         # [B, 64, H/4, W/4]
            x = F.relu(conv3(x)).mean(dim=(2, 3))         # [B, 64]
            return dense(x)                               # [B, 10]

    net = Net()
    with torch.no_grad():
        for p, value in zip(net.parameters(), job.weights):
            p.copy_(torch.from_numpy(_to_torch_layout(value)))
    return net


def _squared_error(torch):
    """A criterion class: sum over the output's columns of (out - t)^2, per example [B]
    with reduction "none", else their mean or sum. (nn.MSELoss with reduction "none"
    would give [B, 1], which Opacus's ghost clipping broadcasts against [B] wrongly.)"""

    class SquaredError(torch.nn.Module):
        """((out - t) ** 2).sum(dim=1), reduced by `self.reduction`."""

        def __init__(self, reduction="mean"):
            super().__init__()
            self.reduction = reduction

        def forward(self, out, t):
            per_example = ((out - t) ** 2).sum(dim=1)              # [B]
            if self.reduction == "none":
                return per_example
            return per_example.sum() if self.reduction == "sum" else per_example.mean()

    return SquaredError


def _to_torch_layout(value):
    """A TF weight in PyTorch's layout: [in, out] -> [out, in]; HWIO -> OIHW."""
    if value.ndim == 2:
        return np.ascontiguousarray(value.T)
    if value.ndim == 4:
        return np.ascontiguousarray(value.transpose(3, 2, 0, 1))
    return value


def _per_example_to_tf_layout(grad):
    """[B, out, in] -> [B, in, out]; [B, O, I, H, W] -> [B, H, W, I, O]; as numpy."""
    grad = grad.detach().numpy()
    if grad.ndim == 3:
        return grad.transpose(0, 2, 1)
    if grad.ndim == 5:
        return grad.transpose(0, 3, 4, 2, 1)
    return grad


def _to_tf_layout(grad):
    """One weight's gradient back in TF's layout (no batch axis)."""
    return _per_example_to_tf_layout(grad[None])[0]



def torch_entries(jobs, check, repeats):
    """(versions, entry dicts) of the PyTorch entries on every job (`peers_jobs.measure`)."""
    import torch  # pylint: disable=import-outside-toplevel
    from torch import func  # pylint: disable=import-outside-toplevel

    # Exact float32 arithmetic, stated rather than assumed: torch can be set (process
    # wide, or by a library) to compute float32 matmuls and oneDNN convolutions in
    # reduced precision (TF32 / bfloat16 passes); "highest" and "ieee" are its switches
    # back to full float32.
    torch.set_float32_matmul_precision("highest")
    mkldnn = torch.backends.mkldnn
    precision = {"matmul": torch.get_float32_matmul_precision()}
    if hasattr(getattr(mkldnn, "conv", None), "fp32_precision"):     # torch >= 2.9
        mkldnn.matmul.fp32_precision = mkldnn.conv.fp32_precision = "ieee"
        precision.update(mkldnn_matmul=mkldnn.matmul.fp32_precision,
                         mkldnn_conv=mkldnn.conv.fp32_precision)
    versions = {"torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                "fp32": precision}
    try:
        import opacus  # pylint: disable=import-outside-toplevel
        versions["opacus"] = opacus.__version__
    except ImportError:
        opacus = None
    entries = []
    for job in jobs:
        classes = job.model == "cifar"
        X = torch.from_numpy(job.x)
        T = torch.from_numpy(job.t.astype(np.int64) if classes else job.t)

        def per_example_loss(out, t):                     # [B]
            if classes:
                return torch.nn.functional.cross_entropy(out, t, reduction="none")
            return ((out - t) ** 2).sum(dim=1)

        def criterion():
            return torch.nn.CrossEntropyLoss() if classes else _squared_error(torch)()

        def vmap_grad():
            net = _torch_model(torch, job)
            params = {k: v.detach() for k, v in net.named_parameters()}

            def one_loss(p, x, t):                        # one example, x [...], t [...]
                out = func.functional_call(net, p, (x[None],))
                return per_example_loss(out, t[None]).sum()

            per_example = func.vmap(func.grad(one_loss), in_dims=(None, 0, 0))
            held = {}

            def run():
                held["grads"] = per_example(params, X, T)  # [B, *p.shape] each

            def result():
                return [_per_example_to_tf_layout(held["grads"][k]) for k in params]
            return run, result

        def opacus_step(mode):
            def build():
                if opacus is None:
                    raise NotImplementedError("opacus is not installed")
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    net = _torch_model(torch, job)
                    optimizer = torch.optim.SGD(net.parameters(), lr=job.lr)
                    loader = torch.utils.data.DataLoader(
                        torch.utils.data.TensorDataset(X, T), batch_size=job.B)
                    made = opacus.PrivacyEngine().make_private(
                        module=net, optimizer=optimizer, criterion=criterion(),
                        data_loader=loader, noise_multiplier=0.0 if check else job.sigma,
                        max_grad_norm=job.clip, poisson_sampling=False,
                        grad_sample_mode=mode)
                if mode == "ghost":
                    net, optimizer, loss_fn, _ = made
                else:
                    net, optimizer, _ = made
                    loss_fn = criterion()
                state = {"first": True}

                def run():
                    optimizer.zero_grad()
                    loss_fn(net(X), T).backward()
                    optimizer.step()
                    if state["first"]:   # the checked step had σ = 0; time with σ
                        state["first"] = False
                        state["grads"] = [_to_tf_layout(p.grad) for p in net.parameters()]
                        optimizer.noise_multiplier = job.sigma

                return run, lambda: state["grads"]
            return build

        entries.append(peers_jobs.measure(job, records.TORCH_VMAP, "gradients", vmap_grad,
                                          check, repeats))
        for name, mode in [(records.OPACUS_HOOKS, "hooks"), (records.OPACUS_GHOST, "ghost")]:
            entry = peers_jobs.measure(job, name, "dp step", opacus_step(mode), check, repeats)
            if entry["reason"].startswith("NotImplementedError"):
                entry["status"] = "n/a"
            entries.append(entry)
    return versions, entries
