"""Small float64 models and a PPO-like per-step loss for checking JAGG gradients
against independent references."""
import torch

M, L, C = 3, 5, 4  # samples, tokens, channels


class AffineVelocity(torch.nn.Module):
    """v = A z + b t + c: the Jacobian d v / d theta is affine in (z, t)."""

    def __init__(self, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.A = torch.nn.Parameter(torch.randn(C, C, generator=g, dtype=torch.float64) * 0.5)
        self.b = torch.nn.Parameter(torch.randn(C, generator=g, dtype=torch.float64))
        self.c = torch.nn.Parameter(torch.randn(C, generator=g, dtype=torch.float64))

    def forward(self, z, t):
        return z @ self.A.T + t.reshape(-1, 1, 1) * self.b + self.c


class NonlinearVelocity(torch.nn.Module):
    """A small MLP in (z, t): its Jacobian is not affine along the trajectory."""

    def __init__(self, seed=0, hidden=8):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.W1 = torch.nn.Parameter(torch.randn(hidden, C + 1, generator=g, dtype=torch.float64))
        self.W2 = torch.nn.Parameter(torch.randn(C, hidden, generator=g, dtype=torch.float64) * 0.5)

    def forward(self, z, t):
        zt = torch.cat([z, t.reshape(-1, 1, 1).expand(*z.shape[:2], 1)], dim=-1)
        return torch.tanh(zt @ self.W1.T) @ self.W2.T


class Problem:
    """A group of W members: states z_j [M, L, C], timesteps t [W, M] (or [W]) and a
    PPO-like loss L_j(v) = sum_i max(-A r, -A clip(r)), r = exp(logp(v) - logp_old)."""

    def __init__(self, model, t, z=None, seed=1, clip=10.0):
        g = torch.Generator().manual_seed(seed)
        self.model, self.t = model, torch.as_tensor(t, dtype=torch.float64)
        width = self.t.shape[0]
        self.z = z if z is not None else torch.randn(width, M, L, C, generator=g, dtype=torch.float64)
        self.target = torch.randn(width, M, L, C, generator=g, dtype=torch.float64)
        self.logp_old = torch.randn(width, M, generator=g, dtype=torch.float64) * 0.1 - 1.0
        self.adv = torch.randn(M, generator=g, dtype=torch.float64)
        self.clip = clip

    @property
    def width(self):
        return self.t.shape[0]

    def t_of(self, j):
        t = self.t[j]
        return t.expand(M) if t.ndim == 0 else t

    def predict(self, j):
        return self.model(self.z[j], self.t_of(j))

    def step_loss(self, j, v):
        logp = -((self.target[j] - v) ** 2).mean(dim=(1, 2))
        ratio = torch.exp(logp - self.logp_old[j])
        clipped = ratio.clamp(1 - self.clip, 1 + self.clip)
        return torch.maximum(-self.adv * ratio, -self.adv * clipped).sum()


def affine_segment_states(t, seed=2):
    """Middle states on the segment between the endpoints at the alpha_j positions."""
    from jagg_patch import interpolation_weights
    g = torch.Generator().manual_seed(seed)
    t = torch.as_tensor(t, dtype=torch.float64)
    alpha = interpolation_weights(t)                      # [W] or [W, M]
    alpha = alpha.reshape(*alpha.shape, *([1] * (4 - alpha.ndim)))
    z0 = torch.randn(M, L, C, generator=g, dtype=torch.float64)
    z1 = torch.randn(M, L, C, generator=g, dtype=torch.float64)
    return (1 - alpha) * z0 + alpha * z1


def params(model):
    return [p for p in model.parameters()]


def flat_grad(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def exact_reference(problem):
    """Float64 autograd of the summed per-step losses: the exact group gradient."""
    total = sum(problem.step_loss(j, problem.predict(j)) for j in range(problem.width))
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(total, params(problem.model))])


def endpoints_reference(problem):
    """The ablation's rule written out: grad of (W/2) (L_0(v_0) + L_{W-1}(v_{W-1}))."""
    w = problem.width
    total = (w / 2) * (problem.step_loss(0, problem.predict(0)) + problem.step_loss(w - 1, problem.predict(w - 1)))
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(total, params(problem.model))])


def jacobian(problem, j):
    """J_j = d v_j / d theta as [M, L*C, P], by torch.autograd.functional (no JAGG code involved)."""
    model = problem.model
    names = [n for n, _ in model.named_parameters()]
    values = tuple(p.detach() for p in model.parameters())

    def v_of(*ps):
        out = torch.func.functional_call(model, dict(zip(names, ps)), (problem.z[j], problem.t_of(j)))
        return out.reshape(M, L * C)

    jac = torch.autograd.functional.jacobian(v_of, values)
    return torch.cat([x.reshape(M, L * C, -1) for x in jac], dim=-1)


def jagg_reference(problem):
    """g = sum_j [(1 - a_j) J_0 + a_j J_{W-1}]^T s_j, from explicit Jacobians and per-sample alphas."""
    w = problem.width
    t = problem.t if problem.t.ndim == 2 else problem.t[:, None].expand(w, M)
    alpha = (t[0] - t) / (t[0] - t[-1])                   # [W, M], written out independently
    j0, j1 = jacobian(problem, 0), jacobian(problem, w - 1)
    g = 0
    for j in range(w):
        v = problem.predict(j).detach().requires_grad_(True)
        (s,) = torch.autograd.grad(problem.step_loss(j, v), v)
        s = s.reshape(M, L * C)
        a = alpha[j][:, None, None]
        jj = (1 - a) * j0 + a * j1
        g = g + torch.einsum("mop,mo->p", jj, s)
    return g


from helpers import relative_error as rel_err  # noqa: E402,F401  (the one relative error, under the toy's name)


def cosine(a, b):
    return float(a @ b / (a.norm() * b.norm()))
