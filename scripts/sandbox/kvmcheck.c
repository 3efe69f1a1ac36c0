/*
 * Minimal proof that /dev/kvm runs guest code: create a VM and a vCPU, run a
 * few real-mode instructions that loop and write to I/O port 0x10, and check
 * the KVM_EXIT_IO exits and the final KVM_EXIT_HLT. Built static by
 * scripts/sandbox/selftest.sh and run inside L1. Exit 0 on success.
 */
#include <errno.h>
#include <fcntl.h>
#include <linux/kvm.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <unistd.h>

#define FAIL(...) do { fprintf(stderr, "kvmcheck: FAIL: " __VA_ARGS__); fputc('\n', stderr); exit(1); } while (0)

int main(void)
{
    /* Real-mode code at guest physical 0x1000:
     *   mov al, 0x42 ; mov dx, 0x10 ; out dx, al
     *   xor bx, bx ; mov cx, 1000
     * l: add bx, cx ; loop l            ; bx = 1000*1001/2 = 500500 mod 65536 = 41620
     *   mov ax, bx ; out dx, ax         ; 16-bit write of 0xa294
     *   hlt
     */
    static const uint8_t code[] = {
        0xb0, 0x42,             /* mov al, 0x42 */
        0xba, 0x10, 0x00,       /* mov dx, 0x10 */
        0xee,                   /* out dx, al */
        0x31, 0xdb,             /* xor bx, bx */
        0xb9, 0xe8, 0x03,       /* mov cx, 1000 */
        0x01, 0xcb,             /* l: add bx, cx */
        0xe2, 0xfc,             /* loop l */
        0x89, 0xd8,             /* mov ax, bx */
        0xef,                   /* out dx, ax */
        0xf4,                   /* hlt */
    };
    const uint16_t expect_sum = (uint16_t)(1000 * 1001 / 2);

    int kvm = open("/dev/kvm", O_RDWR | O_CLOEXEC);
    if (kvm < 0) FAIL("open /dev/kvm: %s", strerror(errno));
    int api = ioctl(kvm, KVM_GET_API_VERSION, 0);
    if (api != KVM_API_VERSION) FAIL("KVM_GET_API_VERSION = %d", api);
    int vm = ioctl(kvm, KVM_CREATE_VM, 0UL);
    if (vm < 0) FAIL("KVM_CREATE_VM: %s", strerror(errno));

    size_t mem_size = 0x10000;
    uint8_t *mem = mmap(NULL, mem_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) FAIL("mmap: %s", strerror(errno));
    memcpy(mem + 0x1000, code, sizeof(code));
    struct kvm_userspace_memory_region region = {
        .slot = 0, .guest_phys_addr = 0, .memory_size = mem_size, .userspace_addr = (uint64_t)mem,
    };
    if (ioctl(vm, KVM_SET_USER_MEMORY_REGION, &region) < 0) FAIL("KVM_SET_USER_MEMORY_REGION: %s", strerror(errno));

    int vcpu = ioctl(vm, KVM_CREATE_VCPU, 0UL);
    if (vcpu < 0) FAIL("KVM_CREATE_VCPU: %s", strerror(errno));
    int run_size = ioctl(kvm, KVM_GET_VCPU_MMAP_SIZE, 0);
    if (run_size <= 0) FAIL("KVM_GET_VCPU_MMAP_SIZE: %s", strerror(errno));
    struct kvm_run *run = mmap(NULL, (size_t)run_size, PROT_READ | PROT_WRITE, MAP_SHARED, vcpu, 0);
    if (run == MAP_FAILED) FAIL("mmap kvm_run: %s", strerror(errno));

    struct kvm_sregs sregs;
    if (ioctl(vcpu, KVM_GET_SREGS, &sregs) < 0) FAIL("KVM_GET_SREGS: %s", strerror(errno));
    sregs.cs.base = 0;
    sregs.cs.selector = 0;
    if (ioctl(vcpu, KVM_SET_SREGS, &sregs) < 0) FAIL("KVM_SET_SREGS: %s", strerror(errno));
    struct kvm_regs regs = { .rip = 0x1000, .rflags = 0x2 };
    if (ioctl(vcpu, KVM_SET_REGS, &regs) < 0) FAIL("KVM_SET_REGS: %s", strerror(errno));

    int step = 0;
    for (;;) {
        if (ioctl(vcpu, KVM_RUN, 0) < 0) FAIL("KVM_RUN: %s (exit_reason %u)", strerror(errno), run->exit_reason);
        if (run->exit_reason == KVM_EXIT_IO) {
            if (run->io.direction != KVM_EXIT_IO_OUT || run->io.port != 0x10 || run->io.count != 1)
                FAIL("unexpected I/O exit: dir %u port 0x%x count %u", run->io.direction, run->io.port, run->io.count);
            uint8_t *data = (uint8_t *)run + run->io.data_offset;
            if (step == 0) {
                if (run->io.size != 1 || data[0] != 0x42) FAIL("first out: size %u data 0x%x", run->io.size, data[0]);
                printf("kvmcheck: KVM_EXIT_IO port 0x10 size 1 data 0x%02x\n", data[0]);
            } else if (step == 1) {
                uint16_t v = (uint16_t)(data[0] | data[1] << 8);
                if (run->io.size != 2 || v != expect_sum) FAIL("second out: size %u data 0x%x (want 0x%x)", run->io.size, v, expect_sum);
                printf("kvmcheck: KVM_EXIT_IO port 0x10 size 2 data 0x%04x (loop sum ok)\n", v);
            } else {
                FAIL("too many I/O exits");
            }
            step++;
        } else if (run->exit_reason == KVM_EXIT_HLT) {
            if (step != 2) FAIL("HLT after %d I/O exits", step);
            printf("kvmcheck: KVM_EXIT_HLT\n");
            break;
        } else if (run->exit_reason == KVM_EXIT_INTERNAL_ERROR) {
            FAIL("KVM_EXIT_INTERNAL_ERROR suberror %u", run->internal.suberror);
        } else {
            FAIL("unexpected exit_reason %u", run->exit_reason);
        }
    }
    printf("kvmcheck: OK (api %d, vcpu mmap %d bytes)\n", api, run_size);
    return 0;
}
