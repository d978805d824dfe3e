import torch,math,random,json,sys,time,os
import torch.nn.functional as F
D=64;W=128;VF=201088
def yarn(tr):
 b=150000.;f=32.;o=4096
 pf=b**(torch.arange(0,D,2).float()/D)
 c=lambda r:(D*math.log(o/(r*2*math.pi)))/(2*math.log(b))
 lo,hi=c(32.),c(1.)
 if tr:lo,hi=math.floor(lo),math.ceil(hi)
 r=((torch.arange(D//2).float()-max(lo,0))/(min(hi,D-1)-max(lo,0))).clamp(0,1)
 return r/(f*pf)+(1-r)/pf,0.1*math.log(f)+1
TK={}
def t(n):
 if n not in TK:TK[n]=len(TK)
 return TK[n]
for g,n in(("nm",32),("nq",32),("cd",40),("md",13),("mq",13),("fl",60),("st",6),("sq",6),("dy",8)):
 [t(g+str(i))for i in range(n)]
def T(s):return[t(w)for w in s.split()]
def fl(r,n):return[t("fl%d"%r.randrange(60))for _ in range(n)]
def item(r,kind,ex,sh=False):
 N=r.randrange(32);C=r.randrange(40);none=r.random()<.2;M=12 if none else r.randrange(12)
 dc=[r.choice([m for m in range(12)if m!=M])for _ in range(r.randint(1,2))]
 S,Dy=r.randrange(6),r.randrange(8)
 pre=T("<S> system <M>")+T(" ".join("sys%d"%i for i in range(40)))+[t("dg%d"%r.randrange(10))for _ in range(8)]+T("eff%d"%r.randrange(3))+T(" ".join("sy%d"%i for i in range(20)))+T("<E>")
 tools=kind=="tool"or r.random()<.3
 if tools or kind=="json":
  pre+=T("<S> developer <M>")+(T(" ".join("js%d"%i for i in range(22)))if kind=="json"else[])+(T(" ".join("tl%d"%i for i in range(55)))if tools else[])+T("<E>")
 fact=T("Access code for")+[t("nm%d"%N)]+T(":")+[t("cd%d"%C)]+T(".")
 req={"recall":T("What is the code of")+[t("nm%d"%N)]+T(", and the current mode ?"),"json":T("Give the code of")+[t("nm%d"%N)]+T("and the current mode ."),"tool":T("Look up the order of")+[t("nm%d"%N)]+T("in the current mode .")}[kind]
 ms=lambda m:T("mode :")+[t("md%d"%m)]+T(".")
 an=T("<S> assistant <C> analysis <M> Code of")+[t("nm%d"%N)]+T(":")+[t("cd%d"%C)]+T(". Current mode :")
 q_off=len(an)-1
 an+=[t("md%d"%M)]+T(". <E>")
 na=r.randint(0,10);far=[fl(r,r.randint(3,12))for _ in dc[1:]];A=fl(r,na);dr=r.randint(20,120)
 if sh:
  u=T("<S> user <M>")+fact+T("Notes :")+A+([]if none else ms(M))+fl(r,r.randint(0,20))+req+T("<E>");p0=len(pre)+len(u)
 else:
  return item_long(r,kind,ex,none,M,dc,pre,fact,req,ms,an,q_off,N,C,S,Dy,far,A,dr)
 return fin(r,kind,pre,u,an,p0,q_off,N,C,M,S,Dy)
def item_long(r,kind,ex,none,M,dc,pre,fact,req,ms,an,q_off,N,C,S,Dy,far,A,dr):
 dn=W if ex else r.randint(W+1,W+42)
 tailmin=4+len(req)+1+q_off
 if dr<tailmin:dr=tailmin
 c=dr-tailmin;gap=dn-dr-4
 if gap<1:dr+=1-gap;c=dr-tailmin;gap=1
 B=fl(r,gap);Cc=fl(r,c)
 while True:
  u=T("<S> user <M>")+fact+T("Notes :")+A
  for m,f in zip(dc[1:],far):u+=ms(m)+f
  u+=ms(dc[0])+B+(fl(r,4)if none else ms(M))+Cc+req+T("<E>")
  p0=len(pre)+len(u)
  regend=len(pre)+3+len(fact)
  if p0-len(req)-1-regend>W:break
  A+=fl(r,W+1-(p0-len(req)-1-regend))
 return fin(r,kind,pre,u,an,p0,q_off,N,C,M,S,Dy)
def fin(r,kind,pre,u,an,p0,q_off,N,C,M,S,Dy):
 toks=pre+u+an;mask=[0]*len(toks)
 for i in range(p0+2,len(toks)):mask[i]=1
 q=p0+q_off
 if kind=="recall":seg=T("<S> assistant <C> final <M>")+[t("nm%d"%N)]+T("has code")+[t("cd%d"%C)]+T(", mode")+[t("md%d"%M)]+T(". <R>");toks+=seg;mask+=[1]*len(seg)
 elif kind=="json":seg=T("<S> assistant <C> final <M> {\" name \": \"")+[t("nq%d"%N)]+T("\", \" code \": _")+[t("cd%d"%C)]+T(", \" mode \": \"")+[t("mq%d"%M)]+T("\"} <R>");toks+=seg;mask+=[1]*len(seg)
 else:
  seg=T("<S> assistant to= functions .lookup _order <C> commentary <K> json <M> {\" order _id \": _")+[t("cd%d"%C)]+T(", \" mode \": \"")+[t("mq%d"%M)]+T("\"} <CALL>");toks+=seg;mask+=[1]*len(seg)
  seg=T("<S> functions .lookup _order to= assistant <C> commentary <M> {\" status \": \"")+[t("sq%d"%S)]+T("\", \" days \": _")+[t("dy%d"%Dy)]+T("} <E> <S> assistant");toks+=seg;mask+=[0]*(len(seg)-2)+[1,1]
  seg=T("<C> final <M> Order")+[t("cd%d"%C)]+T("is")+[t("st%d"%S)]+T(",")+[t("dy%d"%Dy)]+T("days . <R>");toks+=seg;mask+=[1]*len(seg)
 assert toks[q+1]==t("md%d"%M)
 return toks,mask
def data(seed,n,split,exf,sf=0.):
 r=random.Random("%s:%s"%(seed,split));return[item(r,("recall","json","tool")[i%3],r.random()<exf,r.random()<sf)for i in range(n)]
def model(V,init,seed,cfg):
 H,I,L,NQ,NKV,E,K=cfg["h"],cfg["i"],cfg["l"],cfg["nq"],cfg["nkv"],cfg["e"],cfg["k"]
 g=torch.Generator().manual_seed(seed);P={}
 def p(n,*s,std=1.,mean=0.):P[n]=(torch.randn(*s,generator=g)*std+mean)
 p("emb",V+1,H,std=init["embed"])
 for l in range(L):
  p(f"{l}ln1",H,std=0,mean=1);p(f"{l}ln2",H,std=0,mean=1)
  p(f"{l}wq",NQ*D,H,std=init["qk"]/H**.5);p(f"{l}bq",NQ*D,std=.1)
  p(f"{l}wk",NKV*D,H,std=init["qk"]/H**.5);p(f"{l}bk",NKV*D,std=.1)
  p(f"{l}wv",NKV*D,H,std=1/H**.5);p(f"{l}bv",NKV*D,std=.02)
  p(f"{l}wo",H,NQ*D,std=init["out"]/(NQ*D)**.5);p(f"{l}bo",H,std=.02)
  p(f"{l}sk",NQ,std=init["sink_std"],mean=init["sink_mean"])
  p(f"{l}wr",E,H,std=init["router"]/H**.5);p(f"{l}br",E,std=init["router_bias"])
  p(f"{l}gu",E,H,2*I,std=init["gate_up"]/H**.5);p(f"{l}gub",E,2*I,std=init["gate_up_bias"])
  p(f"{l}dn",E,I,H,std=init["out"]/I**.5);p(f"{l}dnb",E,H,std=init["down_bias"])
 p("norm",H,std=0,mean=1);p("head",V+1,H,std=init["head"]/H**.5)
 return P
def fwd(P,ids,cfg,lr_,abl=()):
 H,I,L,NQ,NKV,E,K=cfg["h"],cfg["i"],cfg["l"],cfg["nq"],cfg["nkv"],cfg["e"],cfg["k"]
 B,Tn=ids.shape;dv=ids.device
 inv,sc=yarn("yarn_truncate"in abl);fr=torch.arange(Tn,device=dv).float()[:,None]*inv.to(dv)[None]
 cos,sin=fr.cos()*sc,fr.sin()*sc
 qi=torch.arange(Tn,device=dv)[:,None];ki=torch.arange(Tn,device=dv)[None]
 cau=ki<=qi;w=129 if"band129"in abl else W
 sl=cau if"full_everywhere"in abl else cau&(ki>qi-w)
 rms=lambda x,wt:wt*(x*torch.rsqrt(x.pow(2).mean(-1,keepdim=True)+1e-5))
 x=P["emb"][ids]
 for l in range(L):
  g=lambda n:P[f"{l}{n}"]
  h=rms(x,g("ln1"))
  q=(h@g("wq").T+g("bq")).view(B,Tn,NQ,D).transpose(1,2);k=(h@g("wk").T+g("bk")).view(B,Tn,NKV,D).transpose(1,2);v=(h@g("wv").T+g("bv")).view(B,Tn,NKV,D).transpose(1,2)
  def rot(z):a,b=z.chunk(2,-1);return torch.cat((a*cos-b*sin,b*cos+a*sin),-1)
  q,k=rot(q),rot(k);k=k.repeat_interleave(NQ//NKV,1);v=v.repeat_interleave(NQ//NKV,1)
  at=(q@k.transpose(2,3))*D**-.5
  at=at.masked_fill(~(sl if l%2==0 else cau),torch.finfo(at.dtype).min)
  s=torch.full((B,NQ,Tn,1),float("-inf"),device=dv)if"no_sinks"in abl else g("sk").view(1,NQ,1,1).expand(B,NQ,Tn,1)
  cm=torch.cat([at,s],-1);cm=cm-cm.max(-1,keepdim=True).values
  o=(F.softmax(cm,-1)[...,:-1]@v).transpose(1,2).reshape(B,Tn,NQ*D)
  x=x+o@g("wo").T+g("bo")
  h=rms(x,g("ln2")).reshape(B*Tn,H);rl=h@g("wr").T+g("br")
  tv,ti=torch.topk(rl,K,-1);wt=torch.zeros_like(rl).scatter_(1,ti,F.softmax(tv,1))
  nb="no_bias"in abl
  gu=torch.einsum("nh,ehi->eni",h,g("gu"))+(0 if nb else g("gub")[:,None])
  ga,up=gu[...,::2],gu[...,1::2]
  if"plain_swiglu"in abl:ac=F.silu(ga)*up
  else:ga=ga.clamp(max=7.);up=up.clamp(-7.,7.);ac=(up+1)*(ga*torch.sigmoid(ga*1.702))
  out=torch.einsum("eni,eih->enh",ac,g("dn"))+(0 if nb else g("dnb")[:,None])
  x=x+torch.einsum("enh,ne->nh",out,wt).view(B,Tn,H)
 x=rms(x,P["norm"]);lo=x@P["head"].T
 return torch.cat([lo[...,:-1],lo[...,-1:]+lr_],-1)
def coll(b,dv):
 Tn=max(len(x)for x,_ in b);ids=torch.zeros(len(b),Tn,dtype=torch.long);tg=torch.full((len(b),Tn),-100,dtype=torch.long)
 for i,(x,m)in enumerate(b):
  ids[i,:len(x)]=torch.tensor(x)
  for j in range(1,len(x)):
   if m[j]:tg[i,j-1]=x[j]
 return ids.to(dv),tg.to(dv)
def run(v,tr,ev,dv):
 cfg=dict(h=64,i=128,l=2,nq=4,nkv=2,e=8,k=4);cfg.update(v.get("model",{}))
 init=dict(embed=1.,qk=1.,out=1.,sink_mean=1.,sink_std=1.,router=1.,router_bias=.5,gate_up=1.,gate_up_bias=.5,down_bias=.1,head=1.);init.update(v.get("init",{}))
 steps,bs,lr,seed=v.get("steps",600),v.get("bs",16),v.get("lr",3e-3),v.get("seed",0)
 V=len(TK);lr_=math.log(VF-V)
 P=model(V,init,seed,cfg)
 if v.get("tie"):P["head"]=P["emb"].clone()*init["head"]/cfg["h"]**.5
 P={k:x.to(dv).requires_grad_()for k,x in P.items()}
 opt=torch.optim.AdamW(P.values(),lr=lr,betas=(.9,.95),weight_decay=v.get("wd",0.),eps=1e-8)
 wu=v.get("warmup",30);sch=torch.optim.lr_scheduler.LambdaLR(opt,lambda s:min(1,(s+1)/wu)*(.1+.45*(1+math.cos(math.pi*min(s,steps)/steps))))
 g=torch.Generator().manual_seed(seed+1);order=[]
 while len(order)<steps*bs:order+=torch.randperm(len(tr),generator=g).tolist()
 t0=time.time();hist=[]
 for s in range(steps):
  ids,tg=coll([tr[i]for i in order[s*bs:(s+1)*bs]],dv)
  lo=fwd(P,ids,cfg,lr_);loss=F.cross_entropy(lo.view(-1,lo.shape[-1]),tg.view(-1))
  opt.zero_grad();loss.backward();torch.nn.utils.clip_grad_norm_(P.values(),1.);opt.step();sch.step()
  if s%max(1,steps//6)==0 or s==steps-1:hist.append(round(loss.item(),3))
 res={"v":v,"s":round(time.time()-t0,1),"loss":hist}
 with torch.no_grad():
  for a in["patched","no_sinks","plain_swiglu","no_bias","full_everywhere","band129","yarn_truncate"]:
   ok={0:[0,0],1:[0,0],2:[0,0]}
   for i in range(0,len(ev),48):
    ids,tg=coll(ev[i:i+48],dv);pr=fwd(P,ids,cfg,lr_,(a,)).argmax(-1);o=((pr==tg)|(tg==-100)).all(-1)
    for j in range(len(o)):ok[(i+j)%3][0]+=int(o[j]);ok[(i+j)%3][1]+=1
   res[a]=[round(sum(x[0]for x in ok.values())/len(ev),3)]+[round(x[0]/x[1],2)for x in ok.values()]
 return res
if __name__=="__main__":
 dv="cuda"if torch.cuda.is_available()else"cpu"
 vs=json.loads(sys.argv[1]);out=os.environ.get("OUT",".")
 cache={}
 for v in vs:
  key=(v.get("ntr",3000),v.get("dseed",0),v.get("sf",0.))
  if key not in cache:cache[key]=(data(key[1],key[0],"train",.6,key[2]),data(key[1],240,"eval",1.))
  tr,ev=cache[key]
  if v.get("cpu"):
   torch.set_num_threads(2);vv=dict(v,steps=v["cpu"]);t0=time.time();run(vv,tr,ev[:3],"cpu");print(json.dumps({"v":v,"cpu_s_per_step":round((time.time()-t0)/v["cpu"],3)}),flush=True);continue
  r=run(v,tr,ev,dv);print(json.dumps(r),flush=True)
  open(out+"/s.jsonl","a").write(json.dumps(r)+"\n")
