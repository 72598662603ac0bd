import json, sys, statistics as st
L = json.load(open(sys.argv[1]))
L = [x for x in L if x['decided'] and x['n'] > 1]
for b in sorted({x['n'].bit_length() for x in L}):
    for kind in (True, False):
        xs = [x for x in L if x['n'].bit_length() == b and x['decided'][1] == kind]
        if not xs: continue
        pure = [x for x in xs if x['prompt'] == 0]
        em = sum(x['tokens'] - x['prompt'] for x in xs); s = sum(x['s'] for x in xs)
        pe = sum(x['tokens'] - x['prompt'] for x in pure); ps = sum(x['s'] for x in pure)
        print(f"bucket {1<<(b-1):2d} {'draft' if kind else 'plain'}: steps {len(xs):4d} (pure {len(pure):4d}) "
              f"rows/seq {sum(x['rows']-x['prompt'] for x in xs)/sum(x['n'] for x in xs):.2f} tok/seq {em/sum(x['n'] for x in xs):.2f} "
              f"emitted/s {em/s:7.1f} (+prompt {(em+sum(x['prompt'] for x in xs))/s:7.1f}) pure emitted/s {pe/ps if ps else 0:7.1f} "
              f"prompt/step {st.mean(x['prompt'] for x in xs):5.1f}")
