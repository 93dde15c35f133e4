"""fx -> PyTorch: load fx-saved weights into the reference with strict=True and check that
PyTorch reproduces the fixture's (resp. fx's) outputs. Usage:
    python3 torch_roundtrip_check.py SHARED_DIR EXPORT_DIR
(EXPORT_DIR written by `cargo run -p fx-models --example export_for_torch -- EXPORT_DIR`)."""
import sys, torch
from safetensors.torch import load_file
SHARED, EXP = sys.argv[1], sys.argv[2]
sys.path.insert(0, SHARED + '/reference')
import fx_reference.models as M

def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()

ok = True
def check(name, e, tol=1e-5):
    global ok
    print(f'{name}: rel err {e:.3e}')
    ok &= e <= tol

fx = load_file(SHARED + '/fixtures/dqn.safetensors')
for f in ['dqn_from_fixture', 'dqn_fx_init']:
    net = M.DQN(M.DQNConfig(hidden=64))
    net.load_state_dict(load_file(f'{EXP}/{f}.safetensors'), strict=True)
    with torch.no_grad():
        q = net(fx['in.obs'])
    want = fx['out.q'] if f == 'dqn_from_fixture' else load_file(f'{EXP}/dqn_fx_init_out.safetensors')['q']
    check(f + ' q', rel(q, want))
fx = load_file(SHARED + '/fixtures/ppo.safetensors')
for f in ['ppo_from_fixture', 'ppo_fx_init']:
    m = M.ActorCritic(M.PPOConfig(hidden=64))
    m.load_state_dict(load_file(f'{EXP}/{f}.safetensors'), strict=True)
    with torch.no_grad():
        logits, value = m(fx['in.obs'])
    if f == 'ppo_from_fixture':
        wl, wv = fx['out.logits'], fx['out.value']
    else:
        o = load_file(f'{EXP}/ppo_fx_init_out.safetensors')
        wl, wv = o['logits'], o['value']
    check(f + ' logits', rel(logits, wl))
    check(f + ' value', rel(value, wv))
print('ALL OK' if ok else 'FAILED')
sys.exit(0 if ok else 1)
