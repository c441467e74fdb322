#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <time.h>
#include <sys/mman.h>
#define SZ (512L<<20)
static char* buf; static int T;
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static volatile int sinkv; static __m512i sink[8];
static void* rd(void* a){ long id=(long)a; long per=SZ/T; const char* p=buf+id*per; __m512i s0=_mm512_setzero_si512(),s1=s0,s2=s0,s3=s0;
 for(long i=0;i<per;i+=256){ s0=_mm512_add_epi32(s0,_mm512_load_si512(p+i)); s1=_mm512_add_epi32(s1,_mm512_load_si512(p+i+64)); s2=_mm512_add_epi32(s2,_mm512_load_si512(p+i+128)); s3=_mm512_add_epi32(s3,_mm512_load_si512(p+i+192)); }
 __m512i z=_mm512_add_epi32(_mm512_add_epi32(s0,s1),_mm512_add_epi32(s2,s3)); sinkv+=_mm512_reduce_add_epi32(z); return 0;}
int main(int c,char**v){ buf=aligned_alloc(2<<20,SZ); madvise(buf,SZ,MADV_HUGEPAGE); memset(buf,1,SZ);
 for(T=1;T<=2;T++){ double best=1e9; for(int r=0;r<5;r++){ pthread_t th[2]; double t0=now(); for(long i=1;i<T;i++) pthread_create(&th[i],0,rd,(void*)i); rd(0); for(long i=1;i<T;i++) pthread_join(th[i],0); double t=now()-t0; if(t<best)best=t;} printf("threads=%d read GB/s=%.1f\n",T,SZ/best/1e9);} }
