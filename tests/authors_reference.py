"""The first JAGG author's pass schedule for one window, written out from its description
("The authors' public code") without any jagg_patch code: W forwards without grad for the
upstream gradients (endpoints included), index weights j / (W-1), then for each endpoint
separately a forward WITH grad followed at once by its own backward."""
import torch


def authors_window_backward(predict, step_loss, width):
    """Accumulate the authors' JAGG gradient of one window into the parameters predict reaches.

    predict(j) -> v_j; step_loss(j, v) -> scalar loss of member j. Returns the summed loss."""
    grads, total = [], 0.0
    for j in range(width):
        with torch.no_grad():
            v = predict(j)
        proxy = v.detach().clone().requires_grad_(True)
        with torch.enable_grad():
            loss = step_loss(j, proxy)
            grads.append(torch.autograd.grad(loss, proxy)[0])
        total += float(loss.detach())
    s_base = sum((1 - j / (width - 1)) * g for j, g in enumerate(grads))
    s_corr = sum((j / (width - 1)) * g for j, g in enumerate(grads))
    first = predict(0)
    first.backward(s_base)
    del first
    last = predict(width - 1)
    last.backward(s_corr)
    return total
