"""How close does PyTorch's own bf16 autocast get to the f64 fixtures? Calibrates the
bf16 bounds of the parity tests. Usage:
    python3 bf16_torch_check.py SHARED_DIR      (SHARED_DIR holds reference/ and fixtures/)
"""
import json, sys, torch
from safetensors.torch import load_file
SHARED = sys.argv[1] if len(sys.argv) > 1 else '../../../shared'
sys.path.insert(0, SHARED + '/reference')
import fx_reference.models as M

def rel(a, b):
    a = a.double(); b = b.double()
    return ((a - b).norm() / b.norm()).item() if b.norm() > 0 else (a - b).norm().item()

def run(dev, dtype):
    out = {}
    f = load_file(SHARED + '/fixtures/dqn.safetensors')
    cfg = M.DQNConfig(hidden=64)
    on, tg = M.DQN(cfg).to(dev), M.DQN(cfg).to(dev)
    on.load_state_dict({k: v for k, v in f.items() if k in on.state_dict()})
    tg.load_state_dict({k[7:]: v for k, v in f.items() if k.startswith('target.')})
    g = lambda k: f[k].to(dev)
    with torch.autocast(device_type=dev, dtype=dtype, enabled=dtype != torch.float32):
        loss, parts = M.dqn_loss(on, tg, g('in.obs'), g('in.actions'), g('in.rewards'), g('in.next_obs'), g('in.dones'), return_parts=True)
    loss.float().backward()
    out['dqn.q'] = rel(parts['q'].float().cpu(), f['out.q'])
    out['dqn.loss'] = rel(loss.float().cpu(), f['loss'])
    for n, p in on.named_parameters():
        out['dqn.grad.' + n] = rel(p.grad.cpu(), f['grad.' + n])
    f = load_file(SHARED + '/fixtures/ppo.safetensors')
    ac = M.ActorCritic(M.PPOConfig(hidden=64)).to(dev)
    ac.load_state_dict({k: v for k, v in f.items() if k in ac.state_dict()})
    g = lambda k: f[k].to(dev)
    with torch.autocast(device_type=dev, dtype=dtype, enabled=dtype != torch.float32):
        loss, parts = M.ppo_loss(ac, g('in.obs'), g('in.actions'), g('in.logp_old'), g('in.advantages'), g('in.returns'), return_parts=True)
    loss.float().backward()
    out['ppo.logits'] = rel(parts['logits'].float().cpu(), f['out.logits'])
    out['ppo.loss'] = rel(loss.float().cpu(), f['loss'])
    for n, p in ac.named_parameters():
        out['ppo.grad.' + n] = rel(p.grad.cpu(), f['grad.' + n])
    return out

res = {}
for dev in ['cpu'] + (['cuda'] if torch.cuda.is_available() else []):
    if dev == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = False
    for dt in [torch.float32, torch.bfloat16]:
        res[f'{dev}.{dt}'] = run(dev, dt)
print(json.dumps(res, indent=1))
