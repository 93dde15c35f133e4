import csv,collections,sys
lines=open("ncu-raw.csv").read().splitlines()
start=[i for i,l in enumerate(lines) if l.startswith('"ID"')][0]
rows=list(csv.reader(lines[start:]))
h=rows[0]; data=rows[2:]
ix=lambda k:h.index(k)
K=[(r[ix('Kernel Name')][:70], r[ix('Grid Size')], r[ix('Block Size')], float(r[ix('gpu__time_duration.sum')].replace(',',''))) for r in data]
adam=[i for i,k in enumerate(K) if k[0].startswith('fx_pop_adam')]
print(len(K), adam)
def seg(a,b,show=True):
    tot=0
    for i in range(a+1,b+1):
        n,g,bl,t=K[i]; tot+=t
        if show: print(f"{i:5d} {t/1000:8.2f} us  {g:>16} {bl:>12}  {n}")
    print("total us", tot/1000, "kernels", b-a)
    return tot
for (a,b) in [(453,528),(1236,1316),(3301,3384)]:
    print("=== segment",a,b); seg(a,b)
def cat(n):
    if any(s in n for s in ('nvjet','cutlass','xmma','gemv','internal::kernel')): return 'gemm'
    if n.startswith('fx_'): return n.split('(')[0]
    return 'candle-small'
def cats(a,b):
    c=collections.Counter(); cnt=collections.Counter()
    for i in range(a+1,b+1):
        n,g,bl,t=K[i]; k=cat(n); c[k]+=t/1000; cnt[k]+=1
    tot=sum(c.values())
    for k,v in c.most_common(): print(f"   {k:20s} {v:8.1f} us {100*v/tot:5.1f}% n={cnt[k]}")
# find segments by grid of fx_pop_adam and by members
for i in range(len(adam)-1):
    a,b=adam[i],adam[i+1]
    g=[K[j][1] for j in range(a+1,b+1) if K[j][0].startswith('fx_bias_act')]
    print(i,a,b,b-a, g[0] if g else None, round(sum(K[j][3] for j in range(a+1,b+1))/1000,1))
print("DQN64 graph-ish"); cats(1236,1316)
print("DQN256"); cats(2636,2716)
print("PPO64"); cats(4076,4164)
